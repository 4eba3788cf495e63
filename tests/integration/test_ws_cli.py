"""The CLI over the WebSocket (sdk/cpp): attach, exec, cp, stats, and run --listen."""
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import pty
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import termios
import threading
import time

import pytest

from sbxtest import (CLI, INIT, PROBE, FrameProxy, WsBox, make_tls, mounts_below, read_journal, silent_websocket_server,
                     unmount_below)


def local_env(tmp_path):
    """The environment of a test's local boxes and CLI: a state home of its own (tokens, the
    record of state dirs), no SANDBOXER_TOKEN, and a docker that is not there, so that a name no
    local box has is not taken to a real dockerd."""
    env = {k: v for k, v in os.environ.items() if k != "SANDBOXER_TOKEN"}
    env.update(XDG_STATE_HOME=str(tmp_path / "xdg"), SANDBOXER_DOCKER=str(tmp_path / "no-docker"))
    return env


@pytest.fixture
def box(tmp_path):
    with WsBox(tmp_path, ["sleep", "120"], extra=["--set", "resources.grace=1s"]) as b:
        yield b


def cli(box, *args, timeout=60, **kw):
    return subprocess.run([str(CLI), args[0], *args[1:], "--token-file", str(box.token_file)] if args[0] != "exec"
                          else [str(CLI), "exec", "--token-file", str(box.token_file), *args[1:]],
                          capture_output=True, timeout=timeout, **kw)


def test_exec_exits_with_the_remote_status_and_streams_both_outputs(box):
    r = cli(box, "exec", box.url, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert r.returncode == 7
    assert r.stdout == b"out\n" and r.stderr == b"err\n"


def test_exec_of_a_signaled_process_exits_with_128_plus_the_signal(box):
    r = cli(box, "exec", box.url, "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + 15


def test_exec_i_passes_stdin_with_its_end(box):
    r = cli(box, "exec", box.url, "-i", "--", "sh", "-c", "wc -c; cat >/dev/null", input=b"x" * 100000)
    assert r.returncode == 0 and r.stdout.strip() == b"100000"


def test_exec_i_reads_stdin_that_is_a_file_or_a_device(box, tmp_path):
    # `< file` and `< /dev/null`: stdin that epoll cannot watch. The CLI aborted (libuv's
    # assertion on the read's start, exit 134); a pipe (above) was fine.
    data = os.urandom(3 << 20)
    (tmp_path / "in.bin").write_bytes(data)
    with open(tmp_path / "in.bin", "rb") as f:
        r = cli(box, "exec", box.url, "-i", "--", "sha256sum", stdin=f)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    with open("/dev/null", "rb") as f:
        r = cli(box, "exec", box.url, "-i", "--", "sh", "-c", "wc -c", stdin=f)
    assert r.returncode == 0 and r.stdout.strip() == b"0", r


def test_exec_of_a_missing_program_exits_127_with_the_reason(box):
    r = cli(box, "exec", box.url, "--", "/no/such/thing")
    assert r.returncode == 127 and b"/no/such/thing" in r.stderr


def test_exec_it_gives_a_terminal_that_follows_the_local_size(box):
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(str(CLI), [str(CLI), "exec", "--token-file", str(box.token_file), box.url, "-it", "--",
                            "sh", "-c", "stty size; read x; stty size"])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    out = b""
    deadline = time.monotonic() + 30
    resized = False
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        if not resized and b"30 100" in out:
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 20, 50, 0, 0))
            os.kill(pid, signal.SIGWINCH)
            time.sleep(0.5)
            os.write(fd, b"go\r")
            resized = True
    _, status = os.waitpid(pid, 0)
    assert b"30 100" in out and b"20 50" in out, out
    assert os.waitstatus_to_exitcode(status) == 0


def test_cp_round_trips_a_file_both_ways(box, tmp_path):
    data = os.urandom(5 << 20) + b"tail"
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    up = subprocess.run([str(CLI), "cp", "--token-file", str(box.token_file), str(src), f"{box.url}:/workspace/x.bin"],
                        capture_output=True, timeout=60)
    assert up.returncode == 0, up.stderr
    assert (box.workspace / "x.bin").read_bytes() == data
    back = tmp_path / "back.bin"
    down = subprocess.run([str(CLI), "cp", "--token-file", str(box.token_file), f"{box.url}:/workspace/x.bin", str(back)],
                          capture_output=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(data).digest()
    # Into the box again, over the file: replaced whole (a new inode, renamed over it), its mode kept.
    (box.workspace / "x.bin").chmod(0o600)
    before = (box.workspace / "x.bin").stat().st_ino
    src.write_bytes(b"second")
    up = subprocess.run([str(CLI), "cp", "--token-file", str(box.token_file), str(src), f"{box.url}:/workspace/x.bin"],
                        capture_output=True, timeout=60)
    assert up.returncode == 0, up.stderr
    st = (box.workspace / "x.bin").stat()
    assert (box.workspace / "x.bin").read_bytes() == b"second" and st.st_ino != before and st.st_mode & 0o777 == 0o600
    assert [n for n in os.listdir(box.workspace) if n.startswith(".sbx-write-")] == []


def test_cp_refuses_an_escaping_path(box, tmp_path):
    r = subprocess.run([str(CLI), "cp", "--token-file", str(box.token_file), f"{box.url}:/etc/passwd", str(tmp_path / "p")],
                       capture_output=True, timeout=30)
    assert r.returncode != 0 and b"path_escape" in r.stderr


def test_cp_dash_is_standard_input_or_output_through_a_pipe_and_makes_no_file_of_that_name(box, tmp_path):
    # "-" is stdin/stdout, as to docker cp and tar: 5 MiB from a pipe into the box and back out
    # into a pipe (each spooled through an unnamed file: nothing is left in TMPDIR). It once wrote
    # or read a local file named "-", then was refused.
    data = os.urandom(5 << 20) + b"tail"
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {**os.environ, "TMPDIR": str(spool)}
    cp = [str(CLI), "cp", "--token-file", str(box.token_file)]
    up = subprocess.Popen([*cp, "-", f"{box.url}:/workspace/in.bin"], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                          cwd=tmp_path, env=env)
    _, err = up.communicate(data, timeout=60)
    assert up.returncode == 0, err
    assert (box.workspace / "in.bin").read_bytes() == data
    down = subprocess.run([*cp, f"{box.url}:/workspace/in.bin", "-"], capture_output=True, cwd=tmp_path, env=env,
                          timeout=60)
    assert down.returncode == 0 and down.stdout == data, down.stderr
    assert not (tmp_path / "-").exists() and list(spool.iterdir()) == []
    # A download that fails writes nothing to stdout; -r does not take "-"; "./-" names a file.
    r = subprocess.run([*cp, f"{box.url}:/workspace/none", "-"], capture_output=True, env=env, timeout=30)
    assert r.returncode == 1 and r.stdout == b"" and b"No such file or directory" in r.stderr, r
    r = subprocess.run([*cp, "-r", "-", f"{box.url}:/workspace/t"], capture_output=True, env=env, timeout=30)
    assert r.returncode == 2 and b'-r with "-"' in r.stderr, r
    r = subprocess.run([*cp, f"{box.url}:/workspace/in.bin", "./-"], capture_output=True, cwd=tmp_path, timeout=30)
    assert r.returncode == 0 and (tmp_path / "-").read_bytes() == data, r.stderr
    # A TMPDIR that cannot hold the spool is named.
    r = subprocess.run([*cp, f"{box.url}:/workspace/in.bin", "-"], capture_output=True,
                       env={**env, "TMPDIR": str(tmp_path / "missing")}, timeout=30)
    assert r.returncode == 1 and f"{tmp_path / 'missing'} ($TMPDIR)".encode() in r.stderr and r.stdout == b"", r


def test_stats_prints_the_box_and_its_procs(box):
    r = subprocess.run([str(CLI), "stats", box.url, "--json", "--token-file", str(box.token_file)],
                       capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["box"]["pids"] >= 1


def test_a_wrong_token_is_a_clear_error(box, tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("wrong\n")
    r = subprocess.run([str(CLI), "stats", box.url, "--token-file", str(bad)], capture_output=True, timeout=30)
    assert r.returncode != 0 and r.stderr


def stats_of_port(tmp_path, srv):
    """`sandboxer stats` against the port of the socket `srv` (with some token), which it closes."""
    token = tmp_path / "token"
    token.write_text("x" * 32)
    try:
        return subprocess.run([str(CLI), "stats", f"ws://127.0.0.1:{srv.getsockname()[1]}", "--token-file",
                               str(token)], capture_output=True, timeout=30)
    finally:
        srv.close()


@pytest.mark.parametrize("how", ["close", "reset", "reset-after-request"])
def test_a_server_that_drops_the_connection_before_the_handshake_is_a_clear_error(tmp_path, how):
    # lws 4.1 reports no connection error for these: the CLI waited for ever (seen through
    # docker-proxy while a fork bomb held the container at its pids ceiling).
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def drop_one():
        conn, _ = srv.accept()
        if how == "reset-after-request":
            conn.recv(4096)
        if how != "close":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    t = threading.Thread(target=drop_one, daemon=True)
    t.start()
    r = stats_of_port(tmp_path, srv)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"sandboxer stats: connect to ws://127.0.0.1:{port}: ".encode()), r.stderr
    assert b"\0" not in r.stderr and r.stderr.endswith(b"\n"), r.stderr


def test_a_port_nothing_listens_on_says_connection_refused(tmp_path):
    # lws reports a refused connect as "closed before established", the words it has for a server
    # that accepted and closed: the CLI tells the two apart (before, both printed lws's words).
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]  # bound, never listening: a connect to it is refused
    r = stats_of_port(tmp_path, srv)
    assert r.returncode == 1, r.stderr
    assert r.stderr.decode().startswith(f"sandboxer stats: connect to ws://127.0.0.1:{port}: Connection refused "
                                        f"(nothing listens on 127.0.0.1:{port})"), r.stderr


def test_attach_follows_until_the_box_ends_and_resumes_after_4008(tmp_path):
    # A tiny queue and an attach whose stdout nobody reads for a while: the server closes it with
    # 4008, attach resumes from its last seq, and in the end every seq is there once.
    n = 20 * 1000 * 1000
    agent = ["sh", "-c", "while [ ! -e /workspace/go ]; do sleep 0.01; done; "
             f"{PROBE} spew {n} && touch /workspace/done && sleep 4"]
    # A client that falls behind is served from the journal; one that takes nothing for the stall
    # time (1 s here) is closed with 4008.
    env = dict(os.environ, SANDBOXER_WS_QUEUE_BYTES="262144", SANDBOXER_WS_STALL_SECONDS="1")
    with WsBox(tmp_path, agent, env=env) as box:
        p = subprocess.Popen([str(CLI), "attach", box.url, "--json", "--token-file", str(box.token_file)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # Read until attach is live (it has shown the agent's start), then stop reading its output.
        head = []
        while True:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            head.append(line)
            if b'"proc.started"' in line:
                break
        (box.workspace / "go").touch()
        deadline = time.monotonic() + 60
        while not (box.workspace / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2)  # past the stall time, however fast the agent was
        out, err = p.communicate(timeout=120)
        out = b"".join(head) + out
        assert p.returncode == 0, err
        log = (box.dir / "init.stderr").read_text()
    assert "closing with 4008" in log  # it really was too slow at least once
    seqs = [json.loads(l)["seq"] for l in out.splitlines()]
    assert seqs == list(range(1, len(seqs) + 1))
    assert b"resume" not in err
    text = b"".join(l for l in out.splitlines() if b'"proc.exited"' in l and b'"main"' in l)
    assert text


def test_run_listen_stores_a_token_that_attach_finds_by_url(tmp_path):
    env = local_env(tmp_path)
    p = subprocess.Popen([str(CLI), "run", "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--",
                          "sh", "-c", "echo hello-run; sleep 30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = None
    deadline = time.monotonic() + 20
    line = b""
    while time.monotonic() < deadline and url is None:
        line = p.stderr.readline()
        m = re.search(rb"serving (ws://[0-9.:]+) \(token in (\S+)\)", line)
        if m:
            url, tfile = m.group(1).decode(), m.group(2).decode()
    try:
        assert url, line
        assert os.stat(tfile).st_mode & 0o777 == 0o600
        a = subprocess.run([str(CLI), "exec", url, "--", "echo", "via-stored-token"], capture_output=True, timeout=30, env=env)
        assert a.returncode == 0 and a.stdout == b"via-stored-token\n", a.stderr
        # The token is not on any command line.
        token = open(tfile).read().strip()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    assert token.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    pass
        # Without a stored token, while the box answers: where a token comes from.
        other = dict(env, XDG_STATE_HOME=str(tmp_path / "other"))
        r = subprocess.run([str(CLI), "stats", url], capture_output=True, text=True, timeout=30, env=other)
        assert r.returncode != 0 and f"no token for {url}: give --token-file FILE or SANDBOXER_TOKEN (none stored " \
            "at " in r.stderr, r.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    assert not os.path.exists(tfile)
    assert os.listdir(os.path.dirname(tfile)) == []  # nor the name it had before its port was known
    # Once it has ended, its URL's commands say that nothing answers there (they said where a token
    # comes from, as if the box ran).
    r = subprocess.run([str(CLI), "stats", url], capture_output=True, text=True, timeout=30, env=env)
    where = url.removeprefix("ws://")
    assert r.returncode != 0 and f"no token for {url}, and no box answers there: Connection refused (nothing listens " \
        f"on {where}) (a box removes the token it stored when it ends; `sandboxer ps --all` lists the stopped " \
        "ones)\n" in r.stderr, r.stderr


def test_run_listen_with_its_token_under_tmp_forks(tmp_path):
    # The box masks its token file by the name `run` gave it (pending-...), and a branch's /tmp
    # overlay keeps that name for the mask's mount: `run` renamed the file once the port was
    # known, so a fork of a checkpoint failed, criu finding no mount point ("Can't stat mountpoint
    # .../tokens/pending-...") where the user's state home was under /tmp. The pending name now
    # stays, a second link to the stored token, until the box ends.
    assert str(tmp_path).startswith("/tmp/")
    env = local_env(tmp_path)
    with run_listen_box(tmp_path, env) as url:
        snap = checkpoint(url, env)
        r = subprocess.run([str(CLI), "fork", url, "--snapshot", snap, "-n", "1"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0 and r.stdout == "f1 main@f1\n", r.stderr
    assert os.listdir(tmp_path / "xdg/sandboxer/tokens") == []


@contextlib.contextmanager
def run_listen_box(tmp_path, env, wrap=(), agent=("--", "sleep", "60"), state="s"):
    """`run --listen` of a sleeping agent (or `agent`: run's arguments after --listen), its state
    dir tmp_path/STATE: its URL; ended on leaving. `wrap`: a command that runs `run` (its argv
    comes after)."""
    p = subprocess.Popen([*wrap, str(CLI), "run", "--state-dir", str(tmp_path / state), "--listen", "127.0.0.1:0",
                          *agent], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    try:
        url = None
        while url is None:
            line = p.stderr.readline()
            assert line, p.wait()
            if m := re.search(r"serving (ws://[0-9.:]+) ", line):
                url = m.group(1)
        yield url
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)


def test_run_idle_starts_a_box_a_live_agent_migrates_into(tmp_path):
    # `run` had no --idle (sandboxer-init's alone): `migrate --to URL` and `fork --to URL` need a
    # box waiting for a snapshot, which a user of the CLI could not start.
    env = local_env(tmp_path)
    counter = "import itertools, time\nfor i in itertools.count():\n    print('n', i, flush=True)\n    time.sleep(0.1)\n"
    with run_listen_box(tmp_path, env, agent=("--", "python3", "-c", counter), state="a") as a, \
            run_listen_box(tmp_path, env, agent=("--idle",), state="b") as b:
        assert not any(e["type"] == "proc.started" for e in read_journal(tmp_path / "b"))
        r = subprocess.run([str(CLI), "migrate", a, "--to", b], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0 and r.stdout.split()[-1] == b, (r.stdout, r.stderr)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(e["type"] == "proc.output" for e in read_journal(tmp_path / "b")):
            time.sleep(0.1)
        # The agent goes on in b from the count it had in a (memory, not a new start).
        before = [int(x) for e in read_journal(tmp_path / "a") if e["type"] == "proc.output"
                  for x in e["data"].split()[1::2]]
        after = [int(x) for e in read_journal(tmp_path / "b") if e["type"] == "proc.output"
                 for x in e["data"].split()[1::2]]
        assert before and after and after[0] > 0 and after[0] <= before[-1] + 2, (before[-3:], after[:3])
    # Refused before anything starts: an idle box with a command, or with no API to restore into.
    for args, why in ((["--idle", "--listen", "127.0.0.1:0", "--", "true"], "--idle starts no command"),
                      (["--idle"], "--idle waits for a snapshot over the API: give it --listen")):
        r = subprocess.run([str(CLI), "run", "--state-dir", str(tmp_path / "c"), *args], capture_output=True, text=True,
                           env=env, timeout=30)
        assert r.returncode == 2 and why in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()


def checkpoint(url, env):
    """`sandboxer checkpoint URL`: the snapshot's id."""
    r = subprocess.run([str(CLI), "checkpoint", url], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-1]


def checkpoint_of_an_ended_run_box(tmp_path, env, wrap=()):
    """`run --listen` a sleeping agent, checkpoint it, end the box: the snapshot's id."""
    with run_listen_box(tmp_path, env, wrap) as url:
        return checkpoint(url, env)


def restored_in_a_new_box(tmp_path, snap, env):
    """The snapshot's archive restored by a new sandboxer-init: its restore.done or restore.failed."""
    events = tmp_path / "b.events"
    b = subprocess.Popen([str(INIT), "--state-dir", str(tmp_path / "b"), "--events", str(events), "--restore",
                          str(tmp_path / "s" / "snapshots" / f"{snap}.tar.zst")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.1)
            for line in events.read_text().splitlines() if events.exists() else []:
                if json.loads(line)["type"] in ("restore.done", "restore.failed"):
                    return json.loads(line)
        return None
    finally:
        b.send_signal(signal.SIGTERM)
        b.wait(30)


def test_a_snapshot_of_a_run_listen_box_restores_in_a_new_box_after_the_box_ended(tmp_path):
    # `run` makes the token file in the user's state home, which every box masks whole, and
    # removes it when the box ends. The box masked the token file too, beneath that mask: a mount
    # criu dumped, so a live copy needed its mount point, and every restore of the box's snapshots
    # after it ended failed ("the snapshot's masked path .../tokens/pending-... is not here"). A
    # state home outside /tmp: masks under /tmp get their mount points in the copy's /tmp layer.
    xdg = tempfile.mkdtemp(prefix="sbx-xdg-", dir="/var/tmp")
    try:
        env = dict(local_env(tmp_path), XDG_STATE_HOME=xdg)
        snap = checkpoint_of_an_ended_run_box(tmp_path, env)
        assert os.listdir(os.path.join(xdg, "sandboxer", "tokens")) == []
        ended = restored_in_a_new_box(tmp_path, snap, env)
        assert ended and ended["type"] == "restore.done", ended
        manifest = json.loads((tmp_path / "s" / "snapshots" / f"{snap}.json").read_text())
        assert not any("/tokens/" in m["path"] for m in manifest["masks"]), manifest["masks"]
    finally:
        shutil.rmtree(xdg, ignore_errors=True)


def test_a_live_restore_where_a_mount_its_agent_saw_is_gone_says_which(tmp_path):
    # A box sees the host's directories with what is mounted beneath them, and criu restores each
    # such mount where it was: one gone from the host (a container that ran beside the box) failed
    # the restore with criu's "Can't stat mountpoint" under a directory of its own. The box runs in
    # a mount namespace of its own where a tmpfs over an empty directory under /var/tmp holds the
    # mount point `m` and a tmpfs on it: the suite's other boxes never see them, and the restore,
    # in the host's namespace, finds no `m`.
    env = local_env(tmp_path)
    d = pathlib.Path(tempfile.mkdtemp(prefix="sbx-hostmount-", dir="/var/tmp"))
    try:
        setup = f"mount -t tmpfs tmpfs {d} && mkdir {d}/m && mount -t tmpfs tmpfs {d}/m"
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", setup + ' && exec "$@"', "sh"]
        snap = checkpoint_of_an_ended_run_box(tmp_path, env, wrap)
        manifest = json.loads((tmp_path / "s" / "snapshots" / f"{snap}.json").read_text())
        assert {"path": f"{d}/m", "type": "tmpfs"} in manifest["host_mounts"], manifest["host_mounts"]
        ended = restored_in_a_new_box(tmp_path, snap, env)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    d = d / "m"
    assert ended and ended["type"] == "restore.failed", ended
    assert ended["error"] == f"the snapshot's agent saw a mount at {d} (tmpfs) beneath the host's directories, and " \
        f"{d} is not on this host (No such file or directory): a live copy has the mounts its original saw, each " \
        "where it was; restore it on a host that has it", ended


# -- cp, export and import over sdk/cpp's transfer_file (Boost.Beast) ----------------------------

def test_cp_over_wss_only_to_a_box_whose_certificate_verifies(tmp_path):
    tls = make_tls(tmp_path, names=("127.0.0.1",))
    data = os.urandom(3 << 20)
    with WsBox(tmp_path, ["sleep", "60"], extra=["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]) as box:
        (box.workspace / "f.bin").write_bytes(data)
        url = f"wss://127.0.0.1:{box.port}"
        got = tmp_path / "got.bin"
        # The control: a CA the client does not trust.
        bad = cli(box, "cp", f"{url}:/workspace/f.bin", str(got), env=dict(os.environ, SSL_CERT_FILE=str(tmp_path / "none.pem")))
        assert bad.returncode == 1 and b"certificate verify failed" in bad.stderr, bad.stderr
        assert not got.exists()
        trusted = dict(os.environ, SSL_CERT_FILE=str(tls.ca))
        down = cli(box, "cp", f"{url}:/workspace/f.bin", str(got), env=trusted)
        assert down.returncode == 0, down.stderr
        assert got.read_bytes() == data
        up = cli(box, "cp", str(got), f"{url}:/workspace/back.bin", env=trusted)
        assert up.returncode == 0, up.stderr
        assert (box.workspace / "back.bin").read_bytes() == data


def test_a_request_over_wss_to_an_untrusted_box_says_its_certificate_did_not_verify(tmp_path):
    # The commands on sdk/cpp's Client (libwebsockets): the reason is the one libwebsockets logs
    # ("unable to get local issuer certificate"), in the command's one line, not its log line
    # and a bare "connect SSL err 1: error:00000001:lib(0)::reason(1)".
    tls = make_tls(tmp_path, names=("127.0.0.1",))
    with WsBox(tmp_path, ["sleep", "60"], extra=["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]) as box:
        url = f"wss://127.0.0.1:{box.port}"
        bad = cli(box, "snapshots", url, env=dict(os.environ, SSL_CERT_FILE=str(tmp_path / "none.pem")))
        assert bad.returncode == 1, bad.stderr
        assert bad.stderr.decode() == (f"sandboxer snapshots: connect to {url}: TLS: the box's certificate did not "
                                       "verify: unable to get local issuer certificate (connect)\n"), bad.stderr
        ok = cli(box, "snapshots", url, env=dict(os.environ, SSL_CERT_FILE=str(tls.ca)))
        assert ok.returncode == 0 and ok.stderr == b"", ok.stderr


def test_cp_says_what_failed_and_leaves_the_local_file_as_it_was(box, tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("KEEP\n")
    missing = cli(box, "cp", f"{box.url}:/workspace/missing", str(keep))
    assert missing.returncode == 1 and b"not_found" in missing.stderr, missing.stderr
    wrong = tmp_path / "wrong-token"
    wrong.write_text("w" * 32 + "\n")
    refused = subprocess.run([str(CLI), "cp", "--token-file", str(wrong), f"{box.url}:/workspace/x", str(keep)],
                             capture_output=True, timeout=30)
    assert refused.returncode == 1 and b"HTTP 401" in refused.stderr, refused.stderr
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    nobody = cli(box, "cp", f"ws://127.0.0.1:{port}:/workspace/x", str(keep))
    srv.close()
    assert nobody.returncode == 1, nobody.stderr
    assert nobody.stderr.decode().startswith(f"sandboxer cp: download ws://127.0.0.1:{port}:/workspace/x: connect to "
                                             f"ws://127.0.0.1:{port}: Connection refused (nothing listens on "
                                             f"127.0.0.1:{port})"), nobody.stderr
    assert keep.read_text() == "KEEP\n"


def test_cp_cut_off_mid_download_says_the_connection_closed(box, tmp_path):
    (box.workspace / "f.bin").write_bytes(os.urandom(5 << 20))
    proxy = FrameProxy(box.port, cut=1 << 20)
    r = cli(box, "cp", f"{proxy.url}:/workspace/f.bin", str(tmp_path / "got.bin"))
    assert proxy.acted
    assert r.returncode == 1 and b"the connection closed first" in r.stderr and b"(closed)" in r.stderr, r.stderr


def test_cp_refuses_a_download_whose_frames_skip_bytes(box, tmp_path):
    # A frame lost between the box and the client (here: a proxy drops the second): the next one
    # does not start where the last ended. Before, the copy "succeeded" with a hole of zeros.
    (box.workspace / "f.bin").write_bytes(os.urandom(5 << 20))
    proxy = FrameProxy(box.port, drop=2)
    r = cli(box, "cp", f"{proxy.url}:/workspace/f.bin", str(tmp_path / "got.bin"))
    assert proxy.acted
    assert r.returncode == 1 and b"where byte 262144 was due (protocol)" in r.stderr, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_transfer_waiting_on_a_silent_box_ends_at_an_interrupt(tmp_path, sig):
    srv = silent_websocket_server()
    token = tmp_path / "token"
    token.write_text("x" * 32)
    p = subprocess.Popen([str(CLI), "cp", "--token-file", str(token), f"ws://127.0.0.1:{srv.getsockname()[1]}:/workspace/x",
                          str(tmp_path / "x")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(0.5)
    assert p.poll() is None  # waiting for the reply
    p.send_signal(sig)
    _, err = p.communicate(timeout=10)
    srv.close()
    assert p.returncode == 1 and err.endswith(b": interrupted (interrupted)\n"), err


@pytest.mark.parametrize("cmd", [["attach"], ["log", "--follow"]], ids=["attach", "log-follow"])
def test_following_a_box_never_reached_ends_at_once_saying_why(box, tmp_path, cmd):
    # A wrong port: attach and `log --follow` once retried 20 times (42 s) and then said "closed
    # before established (4401)", the code of a refused token. Now they end at the first failure
    # with what the connect found.
    from sbxtest import free_port_pair
    port = free_port_pair()
    r = subprocess.run([str(CLI), cmd[0], f"ws://127.0.0.1:{port}", *cmd[1:], "--token-file", str(box.token_file)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"Connection refused (nothing listens on 127.0.0.1:{port}) (1006)" in r.stderr, r.stderr
    # The control: the same command against the box, which does listen, follows it.
    p = subprocess.Popen([str(CLI), cmd[0], box.url, *cmd[1:], "--token-file", str(box.token_file)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "box" in p.stdout.readline()  # its first event, box.started
    finally:
        p.kill()
        p.wait()
    # A refused token ends at once too (it was retried for 42 s as well), with its own code.
    bad = tmp_path / "bad"
    bad.write_text("wrong-token\n")
    r = subprocess.run([str(CLI), cmd[0], box.url, *cmd[1:], "--token-file", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "the box refused the token: " in r.stderr and "(4401)" in r.stderr, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
@pytest.mark.parametrize("cmd", [["attach"], ["log", "--follow"]], ids=["attach", "log-follow"])
def test_following_a_box_ends_quietly_on_ctrl_c(box, cmd, sig):
    # "Ctrl-C detaches": the follower leaves with status 0 and says nothing. The build before
    # reported the connection it closed itself as an error: "URL:  (1006)".
    p = subprocess.Popen([str(CLI), cmd[0], box.url, *cmd[1:], "--token-file", str(box.token_file)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "box" in p.stdout.readline()  # its first event, box.started: it follows
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and err == "", (p.returncode, err)


@pytest.mark.parametrize("answer", [b"bad\xffbytes", b"not json"])
def test_a_reply_that_is_not_json_ends_the_request_with_1007_and_says_so(tmp_path, answer):
    # A text frame the client cannot read (not UTF-8, or not JSON) once left the request waiting
    # for a reply forever (the control: this run has a timeout).
    received = []
    srv = silent_websocket_server(answer=answer, received=received)
    token = tmp_path / "token"
    token.write_text("x" * 32)
    try:
        r = subprocess.run([str(CLI), "stats", f"ws://127.0.0.1:{srv.getsockname()[1]}", "--token-file", str(token)],
                           capture_output=True, timeout=30)
    finally:
        srv.close()
    assert r.returncode == 1, r.stderr
    assert b"the box sent a text frame that is not a JSON object" in r.stderr and b"(1007)" in r.stderr, r.stderr
    # The server was told why (a Close frame, 1007), and the client ended the connection though
    # the server never answered its Close (lws waits 5 s for that answer).
    deadline = time.monotonic() + 10
    while received[-1:] != [None] and time.monotonic() < deadline:
        time.sleep(0.05)
    data = b"".join(d for d in received if d)
    assert received[-1:] == [None] and data[:2] == b"\x88\x82", data  # masked Close, 2 bytes
    mask, payload = data[2:6], data[6:8]
    assert int.from_bytes(bytes(b ^ mask[i] for i, b in enumerate(payload)), "big") == 1007


def test_fs_commands_name_a_file_whose_name_is_not_utf8_by_its_bytes(box, tmp_path):
    ws = os.fsencode(box.workspace)
    with open(ws + b"/x\xff", "wb") as f:
        f.write(b"latin-1")
    url = os.fsencode(box.url)
    run_b = lambda *args: subprocess.run([os.fsencode(CLI), *args, b"--token-file", os.fsencode(box.token_file)],
                                         capture_output=True, timeout=60)
    r = run_b(b"ls", url + b":/workspace")
    assert r.returncode == 0 and b"x\\xff" in r.stdout, r  # shown escaped
    assert run_b(b"mkdir", url + b":/workspace/d\xfe").returncode == 0
    r = run_b(b"mv", url + b":/workspace/x\xff", b"/workspace/d\xfe/y\xfd")
    assert r.returncode == 0, r.stderr
    r = run_b(b"cp", url + b":/workspace/d\xfe/y\xfd", os.fsencode(tmp_path) + b"/out")
    assert r.returncode == 0 and open(os.fsencode(tmp_path) + b"/out", "rb").read() == b"latin-1", r.stderr
    # The control: the name as text (U+FFFD for the byte) is another name, which is not there.
    r = run_b(b"rm", url + b":" + "/workspace/d\ufffd".encode())
    assert r.returncode == 1 and b"not_found" in r.stderr, r.stderr
    assert run_b(b"rm", b"-r", url + b":/workspace/d\xfe").returncode == 0
    assert not os.path.lexists(ws + b"/d\xfe") and not os.path.lexists(ws + b"/x\xff")


def test_ls_and_cp_r_take_a_large_directory_in_pages(box, tmp_path):
    # An agent's directory of 25,000 names: `ls` and `cp -r` ask for it 10,000 entries a request,
    # so that no reply holds it whole (before, one reply of 1.4 MB, built on the box's loop).
    many = box.workspace / "many"
    many.mkdir()
    names = [f"n{i:05d}" for i in range(25000)]
    for n in names:
        (many / n).touch()
    with open(os.fsencode(many) + b"/n09999\xff", "wb") as f:  # a name that is not UTF-8, at a page's end
        f.write(b"x")
    proxy = FrameProxy(box.port)
    try:
        r = subprocess.run([str(CLI), "ls", f"{proxy.url}:/workspace/many", "--token-file", str(box.token_file)],
                           capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr
        listed = [line.split(None, 3)[-1] for line in r.stdout.decode().splitlines()]
        assert len(listed) == 25001 and listed == sorted(set(listed)), listed[:3]
        assert set(names) <= set(listed) and "n09999\\xff" in listed
        assert 0 < proxy.largest_text < 1 << 20, proxy.largest_text
    finally:
        proxy.close()
    # cp -r walks it the same way: every file once.
    r = cli(box, "cp", "-r", f"{box.url}:/workspace/many", str(tmp_path / "copy"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(os.fsencode(tmp_path / "copy"))) == sorted(os.listdir(os.fsencode(many)))


def test_ls_lists_a_directory_by_name_and_escapes_what_a_terminal_would_act_on(box):
    ws = box.workspace
    (ws / "b.txt").write_bytes(b"abc")
    (ws / "a dir").mkdir()
    (ws / "title\x1b]0;pwned\x07").write_bytes(b"")
    with open(os.fsencode(ws) + b"/bad\xffname", "wb") as f:
        f.write(b"12345")
    (ws / "link").symlink_to("/etc/passwd")
    (ws / "zlink").symlink_to("\x1b[2J\x9b")  # a symlink's text is escaped as a name is
    r = cli(box, "ls", box.url)  # no path: /workspace
    assert r.returncode == 0, r.stderr
    lines = [l.split(None, 2) for l in r.stdout.decode().splitlines()]
    assert lines == [["dir", "-", "a dir/"], ["file", "3", "B  b.txt"], ["file", "5", "B  bad\\xffname"],
                     ["symlink", "-", "link -> /etc/passwd"], ["file", "0", "B  title\\x1b]0;pwned\\x07"],
                     ["symlink", "-", "zlink -> \\x1b[2J\\xc2\\x9b"]], r.stdout
    assert b"\x1b" not in r.stdout and b"\xff" not in r.stdout
    # --json: each entry as the box gave it; a name that is not UTF-8 has its bytes in name_b64.
    r = cli(box, "ls", f"{box.url}:/workspace", "--json")
    entries = {e["name"]: e for e in json.loads(r.stdout)}
    bad = entries["bad\ufffdname"]
    assert base64.b64decode(bad["name_b64"]) == b"bad\xffname" and bad["size"] == 5
    assert "name_b64" not in entries["b.txt"]
    # A file is listed as itself; what is not there, or outside the roots, is an error.
    r = cli(box, "ls", f"{box.url}:/workspace/b.txt")
    assert r.returncode == 0 and r.stdout.split() == [b"file", b"3", b"B", b"/workspace/b.txt"], r.stdout
    r = cli(box, "ls", f"{box.url}:/workspace/nope")
    assert r.returncode == 1 and b"/workspace/nope: No such file or directory (not_found)" in r.stderr
    r = cli(box, "ls", f"{box.url}:/etc")
    assert r.returncode == 1 and b"(path_escape)" in r.stderr
    r = cli(box, "ls", "/tmp")
    assert r.returncode == 2 and b"expected URL:PATH" in r.stderr
    for url in ("ws://127.0.0.1", "ws://127.0.0.1:/workspace"):
        r = cli(box, "ls", url)
        assert r.returncode == 2 and url.encode() + b": a box's URL names its port (ws://HOST:PORT" in r.stderr, r.stderr
    # An IPv6 host's colons are its own: the port and the path come after its bracket.
    r = cli(box, "ls", "ws://[::1]:1:/workspace")
    assert r.returncode == 1 and b"connect to ws://[::1]:1" in r.stderr, r.stderr


def test_rm_mkdir_and_mv_change_the_boxs_files_and_say_what_a_refusal_needs(box):
    ws = box.workspace
    r = cli(box, "mkdir", f"{box.url}:/workspace/x/y/z")
    assert r.returncode == 1 and b"(-p makes the directories on the way) (not_found)" in r.stderr, r.stderr
    assert not (ws / "x").exists()
    r = cli(box, "mkdir", f"{box.url}:/workspace/x/y/z", "-p")
    assert r.returncode == 0 and (ws / "x/y/z").is_dir(), r.stderr
    assert cli(box, "mkdir", f"{box.url}:/workspace/x").returncode == 0  # there already: fine
    (ws / "x/y/f").write_text("f")
    r = cli(box, "rm", f"{box.url}:/workspace/x")
    assert r.returncode == 1 and b"(-r removes it with what it holds) (not_empty)" in r.stderr, r.stderr
    (ws / "g").write_text("g")
    r = cli(box, "mv", f"{box.url}:/workspace/g", "/workspace/x/y/f")
    assert r.returncode == 1 and b"exists (a regular file); --replace replaces it (exists)" in r.stderr, r.stderr
    r = cli(box, "mv", f"{box.url}:/workspace/g", f"{box.url}:/workspace/x/y/f", "--replace")
    assert r.returncode == 0 and (ws / "x/y/f").read_text() == "g" and not (ws / "g").exists(), r.stderr
    r = cli(box, "mv", f"{box.url}:/workspace/x", "/tmp/x")
    assert r.returncode == 1 and b"copy it out with `sandboxer cp` and back in (cross_root)" in r.stderr, r.stderr
    r = cli(box, "mv", f"{box.url}:/workspace/x", "ws://127.0.0.1:1:/workspace/w")
    assert r.returncode == 2 and b"mv moves within one box" in r.stderr, r.stderr
    r = cli(box, "rm", f"{box.url}:/workspace/x", "-r")
    assert r.returncode == 0 and not (ws / "x").exists(), r.stderr
    r = cli(box, "rm", f"{box.url}:/workspace/x")
    assert r.returncode == 1 and b"(not_found)" in r.stderr


def test_cp_of_a_file_into_a_directory_puts_it_there_by_its_name(box, tmp_path):
    # As cp and docker cp: `sandboxer cp URL:/workspace/f .` was refused ("Is a directory"), and
    # `sandboxer cp f URL:/workspace` said the path named no entry of its own.
    (box.workspace / "f").write_bytes(b"from the box")
    (box.workspace / "sub").mkdir()
    (box.workspace / "rel").symlink_to("sub")
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "out-link").symlink_to(out)
    for dst in (out, f"{out}/", tmp_path / "out-link"):
        r = cli(box, "cp", f"{box.url}:/workspace/f", str(dst))
        assert r.returncode == 0, r.stderr
        assert (out / "f").read_bytes() == b"from the box", dst
        (out / "f").unlink()
    local = tmp_path / "up.txt"
    local.write_bytes(b"from here")
    for dst, at in (("/workspace", "up.txt"), ("/workspace/", "up.txt"), ("/workspace/sub", "sub/up.txt"),
                    ("/workspace/rel", "sub/up.txt")):
        r = cli(box, "cp", str(local), f"{box.url}:{dst}")
        assert r.returncode == 0, (dst, r.stderr)
        assert (box.workspace / at).read_bytes() == b"from here", dst
        (box.workspace / at).unlink()
    # A DST ending in / that is no directory: refused, naming it; nothing made.
    r = cli(box, "cp", f"{box.url}:/workspace/f", f"{tmp_path}/none/")
    assert r.returncode == 1 and f"{tmp_path}/none/f: No such file or directory".encode() in r.stderr, r.stderr
    r = cli(box, "cp", str(local), f"{box.url}:/workspace/none/")
    assert r.returncode == 1 and b"/workspace/none/: " in r.stderr and b"(a DST ending in / names a directory)" in \
        r.stderr, r.stderr
    r = cli(box, "cp", str(local), f"{box.url}:/workspace/f/")
    assert r.returncode == 1 and b": /workspace/f/: Not a directory (a DST ending in / names a directory)" in r.stderr
    assert sorted(os.listdir(box.workspace)) == ["f", "rel", "sub"] and os.listdir(box.workspace / "sub") == []


def test_cp_of_a_directory_names_the_command_that_lists_it(box, tmp_path):
    (box.workspace / "d").mkdir()
    r = cli(box, "cp", f"{box.url}:/workspace/d", str(tmp_path / "d"))
    assert r.returncode == 1, r.stderr
    assert b"is a directory (cp copies one file; `sandboxer ls` lists a directory) (is_a_directory)" in r.stderr
    assert b"fs.list" not in r.stderr


def test_cp_r_copies_a_tree_out_and_in_with_modes_and_symlinks_and_names_what_it_skips(box, tmp_path):
    ws = box.workspace
    (ws / "t/sub/deep").mkdir(parents=True)
    (ws / "t/a").write_bytes(b"a" * 70000)
    (ws / "t/sub/run.sh").write_text("#!/bin/sh\necho hi\n")
    (ws / "t/sub/run.sh").chmod(0o750)
    (ws / "t/sub").chmod(0o750)
    (ws / "t/ro").mkdir()
    (ws / "t/ro/f").write_text("in a read-only directory")
    (ws / "t/ro").chmod(0o555)
    (ws / "t/link").symlink_to("/etc/passwd")
    (ws / "t/sub/rel").symlink_to("../a")
    os.symlink(b"caf\xe9", os.fsencode(ws / "t/latin"))
    os.mkfifo(ws / "t/fifo")
    with open(os.fsencode(ws) + b"/t/bad\xff", "wb") as f:
        f.write(b"named by its bytes")
    out = tmp_path / "out"
    r = cli(box, "cp", "-r", f"{box.url}:/workspace/t", str(out))
    # Everything else is copied; each skipped entry is named, and the status says one was.
    assert r.returncode == 1, r.stderr
    assert r.stderr.decode().splitlines() == [
        "sandboxer cp: skipped /workspace/t/fifo: not a file, a directory or a symlink (a FIFO, a socket or a device)",
    ], r.stderr
    found = sorted(os.fsencode(p.relative_to(out)) for p in out.rglob("*"))
    assert found == [b"a", b"bad\xff", b"latin", b"link", b"ro", b"ro/f", b"sub", b"sub/deep", b"sub/rel",
                     b"sub/run.sh"], found
    assert open(os.fsencode(out) + b"/bad\xff", "rb").read() == b"named by its bytes"  # by its bytes
    assert (out / "a").read_bytes() == b"a" * 70000
    assert (out / "sub/run.sh").stat().st_mode & 0o777 == 0o750
    assert (out / "sub").stat().st_mode & 0o777 == 0o750 and (out / "ro").stat().st_mode & 0o777 == 0o555
    assert (out / "ro/f").read_text() == "in a read-only directory"
    # Symlinks as symlinks, with the box's text (its bytes where they are not UTF-8), not followed.
    assert os.readlink(out / "link") == "/etc/passwd" and os.readlink(out / "sub/rel") == "../a"
    assert os.readlink(os.fsencode(out / "latin")) == b"caf\xe9"
    assert not (tmp_path / "passwd").exists()
    # Into a directory that is there, by its name (cp -r); onto a file, refused.
    (tmp_path / "into").mkdir()
    assert cli(box, "cp", "-r", f"{box.url}:/workspace/t/sub", str(tmp_path / "into")).returncode == 0
    assert (tmp_path / "into/sub/run.sh").read_text() == "#!/bin/sh\necho hi\n"
    r = cli(box, "cp", "-r", f"{box.url}:/workspace/t", str(out / "a"))
    assert r.returncode == 1 and b"/a: File exists (local)" in r.stderr, r.stderr
    # In: the local tree, its symlinks made in the box with the same text (its bytes where they
    # are not UTF-8).
    r = cli(box, "cp", "-r", str(out), f"{box.url}:/workspace/up")
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert (ws / "up/a").read_bytes() == b"a" * 70000
    assert (ws / "up/sub/run.sh").stat().st_mode & 0o777 == 0o750
    assert (ws / "up/sub").stat().st_mode & 0o777 == 0o750 and (ws / "up/ro").stat().st_mode & 0o777 == 0o555
    assert (ws / "up/ro/f").read_text() == "in a read-only directory"
    assert os.readlink(ws / "up/link") == "/etc/passwd" and os.readlink(ws / "up/sub/rel") == "../a"
    assert (ws / "up/sub/deep").is_dir() and os.readlink(os.fsencode(ws / "up/latin")) == b"caf\xe9"
    assert open(os.fsencode(ws) + b"/up/bad\xff", "rb").read() == b"named by its bytes"
    assert cli(box, "cp", "-r", str(out), f"{box.url}:/workspace/up").returncode == 0
    assert (ws / "up/out/a").is_file()  # a directory that is there receives it by its name
    # ls shows where a symlink points.
    r = cli(box, "ls", f"{box.url}:/workspace/up/sub")
    assert r.returncode == 0 and b"symlink" in r.stdout and b"rel -> ../a" in r.stdout, r.stdout
    # -r of a file copies the file.
    assert cli(box, "cp", "-r", f"{box.url}:/workspace/t/a", str(tmp_path / "one")).returncode == 0
    assert (tmp_path / "one").read_bytes() == b"a" * 70000


def test_cp_r_of_a_symlink_copies_the_link_as_cp_r_does_and_plain_cp_follows_it(box, tmp_path):
    ws = box.workspace
    (ws / "d").mkdir()
    (ws / "d/f").write_text("in d")
    (ws / "ld").symlink_to("d")
    (ws / "lf").symlink_to("d/f")
    # Out: the link itself, with its text, by its name into a directory that is there.
    assert cli(box, "cp", "-r", f"{box.url}:/workspace/ld", str(tmp_path / "ld")).returncode == 0
    assert os.readlink(tmp_path / "ld") == "d"
    (tmp_path / "into").mkdir()
    assert cli(box, "cp", "-r", f"{box.url}:/workspace/lf", str(tmp_path / "into")).returncode == 0
    assert os.readlink(tmp_path / "into/lf") == "d/f"
    # The control: without -r, cp copies the file the link names (as cp does).
    assert cli(box, "cp", f"{box.url}:/workspace/lf", str(tmp_path / "plain")).returncode == 0
    assert not (tmp_path / "plain").is_symlink() and (tmp_path / "plain").read_text() == "in d"
    # In: a local link made in the box with the same text, into a directory or as DST itself.
    (tmp_path / "local").symlink_to("/etc/passwd")
    assert cli(box, "cp", "-r", str(tmp_path / "local"), f"{box.url}:/workspace/d").returncode == 0
    assert os.readlink(ws / "d/local") == "/etc/passwd"
    assert cli(box, "cp", "-r", str(tmp_path / "ld"), f"{box.url}:/workspace/ld2").returncode == 0
    assert os.readlink(ws / "ld2") == "d"
    assert cli(box, "cp", str(tmp_path / "into/lf"), f"{box.url}:/workspace/plain").returncode == 1  # dangling here
    # Onto a directory, or a link to one, it goes inside (as cp -r); what is there otherwise is
    # not replaced, and the box says so.
    assert cli(box, "cp", "-r", str(tmp_path / "ld"), f"{box.url}:/workspace/ld2").returncode == 0
    assert os.readlink(ws / "d/ld") == "d"
    r = cli(box, "cp", "-r", str(tmp_path / "ld"), f"{box.url}:/workspace/lf")
    assert r.returncode == 1 and b"exists" in r.stderr, r.stderr
    assert os.readlink(ws / "lf") == "d/f"


def test_cp_r_moves_many_files_in_batches_and_stops_at_the_first_refusal(box, tmp_path):
    # 64 files to a connection: 150 files take three, and every byte arrives.
    src = tmp_path / "many"
    src.mkdir()
    for i in range(150):
        (src / f"f{i:03}").write_bytes(f"{i}\n".encode() * 100)
    r = cli(box, "cp", "-r", str(src), f"{box.url}:/workspace/many")
    assert r.returncode == 0, r.stderr
    got = sorted(p.name for p in (box.workspace / "many").iterdir())
    assert got == [f"f{i:03}" for i in range(150)]
    assert all((box.workspace / "many" / f"f{i:03}").read_bytes() == f"{i}\n".encode() * 100 for i in range(150))
    back = tmp_path / "back"
    assert cli(box, "cp", "-r", f"{box.url}:/workspace/many", str(back)).returncode == 0
    assert all((back / f"f{i:03}").read_bytes() == f"{i}\n".encode() * 100 for i in range(150))
    # A refusal in the middle of a batch (a directory where f080 goes) is named, and what follows
    # it is not sent: the batch's connection ends there.
    # (`again` is there: the tree goes into it by its name, as cp -r does.)
    (box.workspace / "again/many/f080").mkdir(parents=True)
    r = cli(box, "cp", "-r", str(src), f"{box.url}:/workspace/again")
    assert r.returncode == 1, r.stderr
    assert (b"upload to /workspace/again/many/f080: /workspace/again/many/f080: is a directory (is_a_directory)"
            in r.stderr), r.stderr
    assert (box.workspace / "again/many/f079").is_file() and not (box.workspace / "again/many/f081").exists()


def exec_bytes(box, *args):
    return subprocess.run([str(CLI), "exec", "--token-file", str(box.token_file), box.url, *args],
                          capture_output=True, timeout=30)


def test_an_argument_that_is_not_utf8_goes_as_its_bytes_where_the_api_takes_bytes(box, tmp_path):
    # exec's words, --env values and --cwd are bytes (argv_b64, env_b64, cwd_b64); before, the CLI
    # refused them (not_utf8), and before that the box refused the frame whole ("the frame is not
    # valid JSON: syntax error").
    r = exec_bytes(box, "--", "echo", b"a\xffb")
    assert r.returncode == 0 and r.stdout == b"a\xffb\n", r.stderr
    r = exec_bytes(box, "--env", b"K=\xfe", "--env", "L=x", "--", "sh", "-c", 'printf %s "$K$L"')
    assert r.returncode == 0 and r.stdout == b"\xfex", r.stderr
    assert exec_bytes(box, "--", "mkdir", b"/tmp/d\xff").returncode == 0
    r = exec_bytes(box, "--cwd", b"/tmp/d\xff", "--", "pwd")
    assert r.returncode == 0 and r.stdout == b"/tmp/d\xff\n", r.stderr
    # What must be text is named before anything is sent: a process id, an environment name.
    r = exec_bytes(box, "--proc", b"p\xff", "--", "true")
    assert r.returncode == 126, r.stderr
    assert (b'sandboxer exec: proc "p\\xff" is not UTF-8, and the API\'s JSON carries UTF-8 text only (not_utf8)'
            in r.stderr), r.stderr
    r = exec_bytes(box, "--env", b"\xff=1", "--", "true")
    assert r.returncode == 2 and b"the name is not UTF-8 (its value may be any bytes)" in r.stderr, r.stderr
    r = subprocess.run([str(CLI), "ls", "--token-file", str(box.token_file), f"{box.url}:/workspace/".encode() + b"\xff"],
                       capture_output=True, timeout=30)
    # A path is a name of bytes on disk: it goes as its bytes (path_b64), and the box looks for it.
    assert r.returncode == 1 and b"No such file or directory (not_found)" in r.stderr, r.stderr
    assert b"not UTF-8" not in r.stderr
    # cp -r copies such a local name by its bytes, with the rest.
    src = tmp_path / "t"
    src.mkdir()
    (src / "ok").write_text("ok")
    open(os.fsencode(src) + b"/n\xff", "wb").close()
    r = cli(box, "cp", "-r", str(src), f"{box.url}:/workspace/t")
    assert r.returncode == 0, r.stderr
    assert (box.workspace / "t/ok").read_text() == "ok"
    assert sorted(os.listdir(os.fsencode(box.workspace / "t"))) == [b"n\xff", b"ok"]


def test_ps_lists_a_box_with_a_state_dir_of_its_own_and_down_takes_that_dir(tmp_path):
    # A box given --state-dir anywhere: found by the lock its supervisor holds (/proc/locks and the
    # holder's fds), named by its state dir's path; `down` takes that path, relative or not. Before,
    # only boxes under the default root were listed, and `down DIR` went to docker.
    env = local_env(tmp_path)
    state = tmp_path / "my box"
    p = subprocess.Popen([str(INIT), "--state-dir", str(state), "--", "sleep", "60"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            r = subprocess.run([str(CLI), "ps", "--json"], env=env, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            mine = [b for b in map(json.loads, r.stdout.splitlines()) if b["state_dir"] == str(state)]
            if mine:
                break
            assert time.monotonic() < deadline, (r.stdout, r.stderr)
            time.sleep(0.05)
        assert mine == [{"name": str(state), "url": "", "host": "local", "state_dir": str(state), "image": "-",
                         "status": f"running, pid {p.pid}"}], mine
        r = subprocess.run([str(CLI), "down", "my box"], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout == f"box {state} stopped; journal in {state}\n", r
        assert p.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    r = subprocess.run([str(CLI), "ps", "--json"], env=env, capture_output=True, text=True, timeout=30)
    assert str(state) not in r.stdout, r.stdout


def test_ps_lists_the_local_boxes_running_without_a_state_dir_and_down_stops_one(tmp_path):
    # `ps` listed docker's boxes only, and failed (2) where docker did not answer: a box run here
    # could not be found. Now the running boxes under the default state root (their lock held)
    # come first, with the URL the lock names; docker's failure is a line on stderr.
    env = local_env(tmp_path)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16) + "\n")
    token.chmod(0o600)
    # A box that has ended: its state dir stays, unlisted (the control for the lock).
    done = subprocess.run([str(INIT), "--", "true"], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    p = subprocess.Popen([str(INIT), "--listen", "127.0.0.1:0", "--token-file", str(token), "--", "sleep", "60"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        root = tmp_path / "xdg" / "sandboxer" / "boxes"
        deadline = time.monotonic() + 20
        while True:
            r = subprocess.run([str(CLI), "ps", "--json"], env=env, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            # ps lists every box running here: the boxes of the tests beside this one too.
            boxes = [b for b in map(json.loads, r.stdout.splitlines()) if b["state_dir"].startswith(str(tmp_path))]
            if boxes and boxes[0]["url"]:
                break
            assert time.monotonic() < deadline, (r.stdout, r.stderr)
            time.sleep(0.05)
        assert (f"sandboxer ps: docker: run {tmp_path / 'no-docker'}: No such file or directory (docker's boxes are "
                "not listed)") in r.stderr, r.stderr
        assert len(list(root.iterdir())) == 2 and len(boxes) == 1, (list(root.iterdir()), boxes)
        b = boxes[0]
        assert b["host"] == "local" and b["status"] == f"running, pid {p.pid}", b
        assert pathlib.Path(b["state_dir"]).parent == root and b["url"].startswith("ws://127.0.0.1:"), b
        # The URL is the box's: the CLI reaches it there.
        st = subprocess.run([str(CLI), "stats", b["url"], "--json", "--token-file", str(token)], capture_output=True,
                            text=True, timeout=30)
        assert st.returncode == 0 and "main" in json.loads(st.stdout)["procs"], st.stderr
        text = subprocess.run([str(CLI), "ps"], env=env, capture_output=True, text=True, timeout=30).stdout
        assert [b["url"], b["name"], "local"] in [line.split("\t")[:3] for line in text.splitlines()], text
        # `down NAME` stops it as `docker stop` does a container's: TERM, the grace period, the end.
        r = subprocess.run([str(CLI), "down", b["name"]], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == f"box {b['name']} stopped; journal in {b['state_dir']}\n", r
        assert p.wait(timeout=10) == 128 + signal.SIGTERM  # the agent's end: sleep, TERMed
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    ev = read_journal(b["state_dir"])
    assert ev[-1]["type"] == "box.exited" and (ev[-1]["code"], ev[-1]["reason"]) == (143, "shutdown"), ev[-2:]
    r = subprocess.run([str(CLI), "ps", "--json"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and str(tmp_path) not in r.stdout, (r.stdout, r.stderr)
    # A stopped one, by its name: not running, said so.
    r = subprocess.run([str(CLI), "down", b["name"]], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"box {b['name']} was not running; journal in {b['state_dir']}\n", r
    # What is no local box goes to docker, as before, and the failure says there is no local one
    # (it said docker's words alone: "Cannot connect to the Docker daemon" for a URL mistyped).
    r = subprocess.run([str(CLI), "down", "no-such-box"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stderr.startswith(
        "sandboxer down: no local box is no-such-box (sandboxer ps --all lists them); docker's: "), r
    assert f"docker: run {tmp_path / 'no-docker'}: No such file or directory" in r.stderr, r


def test_ps_all_lists_the_stopped_local_boxes_and_how_they_ended(tmp_path):
    # Boxes left running for days: `ps --all` also lists those under the default root that no
    # longer run, with how each ended (its journal's last event), a KILLed one as such.
    env = local_env(tmp_path)
    root = tmp_path / "xdg" / "sandboxer" / "boxes"
    assert subprocess.run([str(INIT), "--", "sh", "-c", "exit 3"], env=env, capture_output=True,
                          timeout=60).returncode == 3
    killed = subprocess.Popen([str(INIT), "--", "sleep", "60"], env=env, stderr=subprocess.DEVNULL)
    running = None
    try:
        def started():  # proc.started in the boxes' journals: the ended one's and the one to kill
            return sum(e["type"] == "proc.started" for d in root.iterdir() if (d / "journal").is_dir()
                       for e in read_journal(d))
        deadline = time.monotonic() + 20
        while started() < 2:
            assert time.monotonic() < deadline and killed.poll() is None
            time.sleep(0.05)
        killed.kill()
        killed.wait(timeout=30)
        known = set(root.iterdir())
        err = tmp_path / "running.err"
        with open(err, "w") as f:
            running = subprocess.Popen([str(INIT), "--", "sleep", "60"], env=env, stderr=f)
        # Its own state dir, once its agent runs (the box has started: box.started is before it).
        while not [d for d in set(root.iterdir()) - known if (d / "journal").is_dir() and any(
                e["type"] == "proc.started" for e in read_journal(d))]:
            assert time.monotonic() < deadline and running.poll() is None, (running.poll(), err.read_text())
            time.sleep(0.05)
        r = subprocess.run([str(CLI), "ps", "--all", "--json"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        mine = [b for b in map(json.loads, r.stdout.splitlines()) if b["state_dir"].startswith(str(root))]
        assert sorted(b["status"] for b in mine) == sorted(
            ["exited 3 (agent_exited)", "ended without box.exited (killed?)", f"running, pid {running.pid}"]), mine
        r = subprocess.run([str(CLI), "ps", "--json"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and [b["status"] for b in map(json.loads, r.stdout.splitlines())
                                      if b["state_dir"].startswith(str(root))] == [f"running, pid {running.pid}"], (
            r.stdout, r.stderr, running.poll(), err.read_text())
    finally:
        for p in (killed, running):
            if p and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_ps_all_lists_the_stopped_boxes_wherever_their_state_dirs_are(tmp_path):
    # `ps --all` listed the stopped boxes under the default root only: one given --state-dir
    # elsewhere was known to no list. Its supervisor records where it ran (STATE_HOME/box-dirs).
    env = local_env(tmp_path)
    a, b = tmp_path / "elsewhere" / "a", tmp_path / "b"
    record = tmp_path / "xdg" / "sandboxer" / "box-dirs"

    def init(*args):
        return subprocess.run([str(INIT), *args], env=env, capture_output=True, text=True, timeout=60)

    def listed():
        r = subprocess.run([str(CLI), "ps", "--all", "--json"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return {b["state_dir"]: b for b in map(json.loads, r.stdout.splitlines())
                if b["state_dir"].startswith(str(tmp_path))}

    assert init("--state-dir", str(a), "--", "sh", "-c", "exit 3").returncode == 3
    assert init("--state-dir", str(b), "--set", "isolation.namespaces=false", "--", "true").returncode == 0
    assert init("--", "true").returncode == 0  # under the default root: listed from there, not recorded
    got = listed()
    root = tmp_path / "xdg" / "sandboxer" / "boxes"
    [default] = [d for d in got if pathlib.Path(d).parent == root]
    assert {k: (v["name"], v["status"]) for k, v in got.items()} == {
        str(a): (str(a), "exited 3 (agent_exited)"), str(b): (str(b), "exited 0 (agent_exited)"),
        default: (pathlib.Path(default).name, "exited 0 (agent_exited)")}, got
    # A box started again on its state dir is recorded again: listed once, and the record keeps it
    # once after `ps` (a compaction's first line, then each dir).
    assert init("--state-dir", str(a), "--", "true").returncode == 0
    assert len(record.read_text().splitlines()) == 3
    assert listed()[str(a)]["status"] == "exited 0 (agent_exited)"
    assert [json.loads(line) for line in record.read_text().splitlines()][1:] == [{"dir": str(a)}, {"dir": str(b)}]
    # A state dir removed leaves the list, and the record.
    shutil.rmtree(b)
    assert set(listed()) == {str(a), default}
    assert str(b) not in record.read_text()
    # The control: without the record, the stopped box outside the default root is listed no more.
    record.unlink()
    assert set(listed()) == {default}
    # A record that is no file of this user's is not followed: the box runs all the same and says
    # why `ps` will miss it; `ps` names it and lists the rest.
    target = tmp_path / "target"
    target.write_text("")
    record.symlink_to(target)
    r = init("--state-dir", str(a), "--", "true")
    why = f"{record} is a symlink: not a record this user's boxes keep"
    assert r.returncode == 0 and f"`sandboxer ps --all` will not list this box once it has stopped: {why}" in r.stderr, r
    assert target.read_text() == ""
    r = subprocess.run([str(CLI), "ps", "--all"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and f"sandboxer ps: {why} (the stopped boxes outside {root} are not listed)" in r.stderr, r
    assert pathlib.Path(default).name in r.stdout and str(a) not in r.stdout, r.stdout


def box_sleeping(state, env, *options):
    """A box on `state` whose agent sleeps a minute, once its agent has started (proc.started)."""
    p = subprocess.Popen([str(INIT), "--state-dir", str(state), *options, "--", "sleep", "60"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not (state / "journal").is_dir() or not [e for e in read_journal(state) if e["type"] == "proc.started"]:
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            raise AssertionError(f"the box on {state} did not start its agent (exit status {p.wait()})")
        time.sleep(0.05)
    return p


def groups_named(prefix, root="/sys/fs/cgroup", depth=6):
    """The cgroup directories whose names start with `prefix`, in any hierarchy."""
    found = []
    for top, dirs, _ in os.walk(root):
        if top.count("/") - root.count("/") >= depth:
            dirs[:] = []
        found += [os.path.join(top, d) for d in dirs if d.startswith(prefix)]
        dirs[:] = [d for d in dirs if not d.startswith(prefix)]
    return sorted(found)


def wait_groups_empty(groups, timeout=30):
    """Waits until no process is in any of `groups` (a killed supervisor's tree ends by itself:
    its ns-init has lost its parent; under ASan that takes a while)."""
    deadline = time.monotonic() + timeout
    while any(pathlib.Path(g, "cgroup.procs").read_text().strip() for g in groups):
        assert time.monotonic() < deadline, [pathlib.Path(g, "cgroup.procs").read_text() for g in groups]
        time.sleep(0.05)


def test_down_of_a_killed_box_leaves_cgroups_that_hold_processes_or_a_running_box_shares(tmp_path):
    # `down` removes the empty cgroups a killed supervisor left, found by the box's id wherever
    # they are; it kills nothing: a group that holds a process (which may be a running box's: a
    # copy of the state dir carries its id) is named and left, as are all where a box listed as
    # running has the id.
    env = local_env(tmp_path)
    state, twin = tmp_path / "state", tmp_path / "twin"
    running = None
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        p = box_sleeping(state, env)
        p.kill()
        p.wait(timeout=30)
        box_id = json.loads((state / "box.json").read_text())["id"]
        groups = groups_named(f"sbx-{box_id}-")
        assert groups
        wait_groups_empty(groups)
        for g in groups:  # a process of its own in each, as a running box's agent would be
            pathlib.Path(g, "cgroup.procs").write_text(str(sleeper.pid))
        r = subprocess.run([str(CLI), "down", str(state)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and sleeper.poll() is None, r
        assert f"sandboxer down: cgroup sbx-{box_id}-main: it holds 1 process; left as it is\n" in r.stderr, r.stderr
        assert groups_named(f"sbx-{box_id}-") == groups
        for g in groups:
            (pathlib.Path(g).parent / "cgroup.procs").write_text(str(sleeper.pid))
        # A process in the group of one hierarchy only, not the first `down` reads (v1 allows it):
        # named and left too. The build before read the first and, its rmdir refused there, killed it.
        pids_group = [g for g in groups if "/memory/" not in g][-1]  # memory's is the first
        pathlib.Path(pids_group, "cgroup.procs").write_text(str(sleeper.pid))
        r = subprocess.run([str(CLI), "down", str(state)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and sleeper.poll() is None, r
        assert f"sandboxer down: cgroup sbx-{box_id}-main: it holds 1 process; left as it is\n" in r.stderr, r.stderr
        assert groups_named(f"sbx-{box_id}-") == groups
        (pathlib.Path(pids_group).parent / "cgroup.procs").write_text(str(sleeper.pid))
        # One it cannot remove (a group inside it) is named, not said removed.
        inner = pathlib.Path(groups[0], "inner")
        inner.mkdir()
        try:
            r = subprocess.run([str(CLI), "down", str(state)], env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and "removed cgroup" not in r.stdout, r
            assert f"sandboxer down: cgroup sbx-{box_id}-main: could not remove {groups[0]}\n" in r.stderr, r.stderr
        finally:
            inner.rmdir()
        # A running box with the same id (its state dir a copy of this one's) has its groups left
        # alone, and said so.
        twin.mkdir()
        (twin / "box.json").write_text(json.dumps({"id": box_id}) + "\n")
        running = box_sleeping(twin, env)
        r = subprocess.run([str(CLI), "down", str(state)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"left its cgroups (sbx-{box_id}-*): box {twin}, which runs, has its id\n" in \
            r.stdout, r
        assert groups_named(f"sbx-{box_id}-main") and running.poll() is None
    finally:
        for q in (sleeper, running):
            if q and q.poll() is None:
                q.kill()
                q.wait(timeout=30)


def test_ps_on_a_host_without_docker_says_nothing_of_docker(tmp_path):
    # Every `ps` said "docker: not found on PATH ... (docker's boxes are not listed)" on a host
    # that has no docker, where there are none to list. A docker that is named but cannot answer
    # is still said (the control).
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SANDBOXER_DOCKER"}
    env.update(PATH=str(tmp_path / "bin"), XDG_STATE_HOME=str(tmp_path / "xdg"))
    r = subprocess.run([str(CLI), "ps"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("URL\tNAME"), r
    r = subprocess.run([str(CLI), "ps"], env=dict(env, SANDBOXER_DOCKER=str(tmp_path / "no-docker")),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stderr.endswith("(docker's boxes are not listed)\n"), r


def test_down_rm_removes_a_boxs_state_dir_and_nothing_else(tmp_path):
    # `ps --all` lists every stopped box; `down --rm` is how one goes: a running one stopped first,
    # a killed one's leftovers released, then its state dir removed (journal, snapshots, files),
    # under its lock, on its own filesystem only and following no symlink.
    env = local_env(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")

    def down_rm(which):
        return subprocess.run([str(CLI), "down", "--rm", str(which)], env=env, capture_output=True, text=True,
                              timeout=60)

    # A stopped box whose agent left a link to a file outside and a directory it may not write.
    done = tmp_path / "done"
    script = f"ln -s {outside}/keep /workspace/link && mkdir /workspace/ro && touch /workspace/ro/f && chmod 500 " \
             "/workspace/ro"
    r = subprocess.run([str(INIT), "--state-dir", str(done), "--", "sh", "-c", script], env=env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    r = down_rm(done)
    assert r.returncode == 0 and r.stdout == (f"box {done} was not running; journal in {done}\n"
                                              f"removed its state dir {done} (journal, snapshots, files)\n"), r
    assert not done.exists() and (outside / "keep").read_text() == "keep"
    r = subprocess.run([str(CLI), "ps", "--all", "--json"], env=env, capture_output=True, text=True, timeout=30)
    assert str(done) not in r.stdout, r.stdout
    # A running one: TERM and its grace period, then the state dir.
    running = tmp_path / "running"
    p = box_sleeping(running, env)
    try:
        r = down_rm(running)
        assert r.returncode == 0 and r.stdout.endswith(f"removed its state dir {running} (journal, snapshots, "
                                                       "files)\n"), r
        assert p.wait(timeout=10) == 128 + signal.SIGTERM and not running.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    # A killed one, its workspace's tmpfs left mounted: unmounted, then removed.
    killed = tmp_path / "killed"
    p = box_sleeping(killed, env, "--set", "resources.disk=16M")
    box_id = json.loads((killed / "box.json").read_text())["id"]
    p.kill()
    p.wait(timeout=30)
    try:
        wait_groups_empty(groups_named(f"sbx-{box_id}-"))
        r = down_rm(killed)
        assert r.returncode == 0 and "(tmpfs), which its supervisor left mounted\n" in r.stdout, r
        assert not killed.exists() and mounts_below(killed) == []
    finally:
        unmount_below(killed)
    # A killed one whose cgroups still hold a process (an agent that outlived its supervisor, as
    # one without namespaces may): its groups named and left, its state dir kept, nothing killed.
    # The control: once the process has left, the same command removes it. (The build before
    # removed the state dir from under the process.)
    held = tmp_path / "held-by-process"
    p = box_sleeping(held, env)
    box_id = json.loads((held / "box.json").read_text())["id"]
    p.kill()
    p.wait(timeout=30)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        groups = groups_named(f"sbx-{box_id}-")
        wait_groups_empty(groups)
        for g in groups:
            pathlib.Path(g, "cgroup.procs").write_text(str(sleeper.pid))
        r = down_rm(held)
        assert r.returncode != 0 and sleeper.poll() is None, r
        assert r.stderr == (f"sandboxer down: cgroup sbx-{box_id}-main: it holds 1 process; left as it is\n"
                            f"sandboxer down: box {held}: its cgroups still hold processes (named above): its state "
                            "dir is not removed; end them and run `sandboxer down --rm` again\n"), r.stderr
        assert (held / "journal").is_dir() and (held / "box.json").is_file()
        for g in groups:
            (pathlib.Path(g).parent / "cgroup.procs").write_text(str(sleeper.pid))
        r = down_rm(held)
        assert r.returncode == 0 and r.stdout.endswith(f"removed its state dir {held} (journal, snapshots, files)\n"), r
        assert not held.exists() and groups_named(f"sbx-{box_id}-") == [] and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    # A directory with a box.json but no journal is no box's state dir: left whole. The control:
    # with a journal directory, what a box makes there is removed (its own file stays).
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "box.json").write_text("{}\n")
    (fake / "data").write_text("mine")
    r = down_rm(fake)
    assert r.returncode != 0 and r.stderr == (f"sandboxer down: {fake} holds no journal directory: not a box's state "
                                              "dir, nothing removed\n"), r
    assert (fake / "data").read_text() == "mine"
    (fake / "journal").mkdir()
    assert down_rm(fake).returncode == 0 and [p.name for p in fake.iterdir()] == ["data"]
    # A state dir given as a directory of the user's own files: what the box made goes, the rest
    # and the directory stay.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / ".box.json.tmp-notmine").mkdir()  # a name like a temporary's, of another kind: still the box's
    assert subprocess.run([str(INIT), "--state-dir", str(mine), "--", "true"], env=env, capture_output=True,
                          timeout=60).returncode == 0
    r = down_rm(mine)
    assert r.returncode == 0 and r.stdout.endswith(
        f"removed what the box made in {mine} (journal, snapshots, files); left the directory and what no box "
        "makes: notes.txt\n"), r
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    # A mount its supervisor did not make, in the state dir: nothing is removed.
    held = tmp_path / "held"
    assert subprocess.run([str(INIT), "--state-dir", str(held), "--", "true"], env=env, capture_output=True,
                          timeout=60).returncode == 0
    (held / "extra").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(held / "extra")], check=True)
    try:
        r = down_rm(held)
        assert r.returncode != 0 and f"{held}/extra is mounted in its state dir; nothing removed" in r.stderr, r
        assert (held / "journal").is_dir()
    finally:
        subprocess.run(["umount", str(held / "extra")], check=False)
    # What no local box is named: --rm does not reach docker.
    r = down_rm("no-such-box")
    assert r.returncode != 0 and "--rm removes a local box's state dir: no local box is named no-such-box" in \
        r.stderr and "docker: run" not in r.stderr, r


def test_down_of_a_box_whose_supervisor_was_killed_releases_what_it_left(tmp_path):
    # A supervisor KILLed (the host's OOM killer) holds no lock: `down DIR` went to docker, which
    # knew nothing of it, and the branch's tmpfs stayed mounted in the host's mount namespace.
    # Now the box is said not to run, and what it left mounted is unmounted.
    env = local_env(tmp_path)
    state = tmp_path / "state"
    p = box_sleeping(state, env, "--set", "resources.disk=16M")
    try:
        p.kill()
        p.wait(timeout=30)
        assert len(mounts_below(state)) == 2  # the branch's dir and its workspace
        box_id = json.loads((state / "box.json").read_text())["id"]
        assert groups_named(f"sbx-{box_id}-")  # the branch's cgroups, one a hierarchy
        wait_groups_empty(groups_named(f"sbx-{box_id}-"))
        r = subprocess.run([str(CLI), "down", str(state)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r
        assert r.stdout == (f"unmounted {state}/branches/main/workspace (tmpfs), which its supervisor left mounted\n"
                            f"unmounted {state}/branches/main (tmpfs), which its supervisor left mounted\n"
                            f"removed cgroup sbx-{box_id}-main, which its supervisor left\n"
                            f"box {state} was not running; journal in {state}\n"), r.stdout
        assert mounts_below(state) == []
        assert groups_named(f"sbx-{box_id}-") == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        unmount_below(state)


class HostileBox:
    """A WebSocket server on 127.0.0.1 speaking the protocol with fields of the wrong types: what a
    box of another version, or a hostile one on another machine, may send the CLI."""

    def __init__(self, tmp_path):
        import asyncio
        from websockets.asyncio.server import serve
        self.token_file = tmp_path / "hostile-token"
        self.token_file.write_text("t\n")
        self.token_file.chmod(0o600)
        self.bad_stats = True
        ready = threading.Event()

        async def handler(ws):
            async for m in ws:
                if isinstance(m, bytes):
                    continue
                r = json.loads(m)
                if r.get("op") == "stats" and self.bad_stats:
                    await ws.send(json.dumps({"id": r.get("id"), "ok": True, "box": 5}))
                elif r.get("op") == "stats":
                    await ws.send(json.dumps({"id": r.get("id"), "ok": True, "box": {}, "last_seq": 2}))
                elif r.get("op") == "subscribe":
                    await ws.send(json.dumps({"id": r.get("id"), "ok": True, "last_seq": 2}))
                    await ws.send(json.dumps({"seq": 1, "ts": "x", "type": "proc.output", "proc": "main", "data": 5}))
                    await ws.send(json.dumps({"seq": 2, "ts": "x", "type": "proc.output", "proc": "main",
                                              "stream": "stdout", "data": "after\n"}))

        async def main():
            async with serve(handler, "127.0.0.1", 0, subprotocols=["sandboxer.v1"]) as server:
                self.url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
                self.stop = asyncio.get_running_loop().create_future()
                self.loop = asyncio.get_running_loop()
                ready.set()
                await self.stop

        self.thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set_result, None)
        self.thread.join(10)


def test_replies_and_events_of_the_wrong_types_are_named_not_fatal(tmp_path):
    # A reply field of another type gave boost's bare words and exit 2 (usage); an event's ended
    # the connection with no reason, the event counted as read (`attach` reconnected for ever).
    hostile = HostileBox(tmp_path)
    try:
        env = local_env(tmp_path)
        r = subprocess.run([str(CLI), "stats", hostile.url, "--token-file", str(hostile.token_file)],
                           capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "the box sent a reply this CLI cannot read (not an object)" in r.stderr, r.stderr
        hostile.bad_stats = False
        r = subprocess.run([str(CLI), "log", hostile.url, "--token-file", str(hostile.token_file)],
                           capture_output=True, text=True, timeout=30, env=env)
        assert '"data": 5} (an event this CLI cannot show: not a string)\n' in r.stdout, (r.stdout, r.stderr)
        assert "main | after\n" in r.stdout, (r.stdout, r.stderr)
        assert r.returncode == 0, (r.returncode, r.stderr)
    finally:
        hostile.close()
