"""Files the supervisor writes or reads where the agent writes (issue #13 items 4, 5, 7, 12).

The agent (root in its box) plants symlinks and FIFOs where the supervisor copies a snapshot's
files, writes branch.json, or serves fs.read/fs.write; the CLI's token dir without HOME sits in
/tmp. Each attack asserts the refusal (or that the host file is untouched) and the reason; each
has a control that runs the old, path-based logic on the same planted tree, or the same open on
this host, to show the attack primitive works and the test can fail."""
import contextlib
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from sbxtest import CLI, INIT, ROOT, Session, WsBox, box, of_type, read_journal, run, ws_connect


AGENT = pathlib.Path(__file__).resolve().parent / "agents" / "files.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"

have_criu = shutil.which("criu") is not None and os.geteuid() == 0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def agent_env(live):
    e = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    if not live:
        # No criu on PATH: a fork is a cold restart of the agent's command on a copy of its files.
        e["PATH"] = ":".join(d for d in e["PATH"].split(":") if not os.path.exists(os.path.join(d, "criu")))
    return e


def messages(events):
    return [e["message"] for e in events if e["type"] == "proc.message"]


def victim_dir(tmp_path):
    v = tmp_path / "victim"
    v.mkdir()
    v.chmod(0o755)
    (v / "keep").write_text("host file\n")
    return v


def naive_copy(src, dst):
    """The old copy_tree: mkdir with EEXIST ignored, chmod and open(O_TRUNC) by path."""
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.makedirs(dst, exist_ok=True)
        os.chmod(dst, st.st_mode & 0o7777)
        for n in os.listdir(src):
            naive_copy(os.path.join(src, n), os.path.join(dst, n))
    elif stat.S_ISLNK(st.st_mode):
        if os.path.lexists(dst):
            os.unlink(dst)
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        with open(src, "rb") as i, open(dst, "wb") as o:
            o.write(i.read())


# ---- item 4: copy_tree ----

@needs_root
@pytest.mark.parametrize("mode", ["cold", pytest.param("live", marks=pytest.mark.skipif(
    not have_criu, reason="needs criu on PATH"))])
def test_a_symlink_in_tmp_swapped_for_a_directory_in_a_copy_does_not_reach_the_host(tmp_path, mode):
    victim = victim_dir(tmp_path)
    s = tmp_path / "s"
    r, ev = box(s, [sys.executable, AGENT, "tmp-swap", victim], timeout=120, env=agent_env(mode == "live"))
    assert r.returncode == 0, r.stderr
    done = of_type(ev, "restore.done")
    assert len(done) == 1 and done[0]["mode"] == mode, ev
    copy = next(m for m in messages(ev) if m.get("copy"))
    # The host directory is as it was: not made 0777, nothing written into it.
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755
    assert sorted(p.name for p in victim.iterdir()) == ["keep"]
    # The copy's checkpoint took its /tmp from one place: x is its directory, not the symlink.
    assert copy["checkpoint"]["ok"] is True, copy
    snap = s / "snapshots" / (copy["checkpoint"]["snapshot"] + ".d") / "fs" / "tmp" / "x"
    assert snap.is_dir() and not snap.is_symlink()
    assert (snap / "ld.so.preload").read_text() == "/workspace/evil.so\n"
    assert stat.S_IMODE(snap.stat().st_mode) == 0o777
    if mode == "cold":
        # Control: the old copy (both of the copy's /tmp directories into one place, by path) on
        # the very tree the agent left makes the host directory 0777 and writes into it.
        b = s / "branches" / done[0]["branch"]
        assert (b / "tmp" / "x").is_symlink() and (b / "tmp-upper" / "x").is_dir()
        out = tmp_path / "control" / "tmp"
        naive_copy(b / "tmp", out)
        naive_copy(b / "tmp-upper", out)
        assert stat.S_IMODE(victim.stat().st_mode) == 0o777
        assert (victim / "ld.so.preload").read_text() == "/workspace/evil.so\n"


# ---- item 5: write_file_atomic ----

@needs_root
@pytest.mark.parametrize("mode", ["cold", pytest.param("live", marks=pytest.mark.skipif(
    not have_criu, reason="needs criu on PATH"))])
def test_symlinks_at_branch_json_and_its_temporary_do_not_reach_the_host(tmp_path, mode):
    v1, v2 = tmp_path / "victim1", tmp_path / "victim2"
    v1.write_text("host file 1\n")
    v2.write_text("host file 2\n")
    s = tmp_path / "s"
    r, ev = box(s, [sys.executable, AGENT, "run-plant", v1, v2], timeout=120, env=agent_env(mode == "live"))
    assert r.returncode == 0, r.stderr
    done = of_type(ev, "restore.done")
    assert len(done) == 1 and done[0]["mode"] == mode, ev
    copy = next(m for m in messages(ev) if m.get("copy"))
    assert v1.read_text() == "host file 1\n" and v2.read_text() == "host file 2\n"
    # The copy's branch.json is a file of its own, saying who it is.
    assert copy["regular"] is True, copy
    assert copy["branch_json"]["branch"] == done[0]["branch"] and copy["branch_json"]["mode"] == mode
    # Control: the old write (PATH.tmp.<pid>, O_CREAT|O_TRUNC, by path) on the copy's planted
    # /run/sandboxer truncates and writes the host file.
    d = s / "branches" / done[0]["branch"] / "run" / "sandboxer"
    assert (d / "branch.json.tmp.1").is_symlink()
    fd = os.open(d / "branch.json.tmp.1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"{}\n")
    os.close(fd)
    assert v1.read_text() == "{}\n"


# ---- item 7: fs.read / fs.write of what is not a regular file ----

@pytest.fixture
def fifo_box(tmp_path):
    argv = ["sh", "-c", "mkfifo /workspace/fifo && mknod /workspace/null c 1 3; touch /workspace/ready; sleep 120"]
    with WsBox(tmp_path, argv, extra=["--set", "resources.grace=1s"]) as b:
        deadline = time.monotonic() + 15
        while not (b.workspace / "ready").exists():
            assert time.monotonic() < deadline, "the agent made no FIFO"
            time.sleep(0.05)
        if not (b.workspace / "null").exists():
            # The profile kept CAP_MKNOD from the agent: a device node at the path all the same.
            os.mknod(b.workspace / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        yield b


@pytest.mark.parametrize("name,kind", [("fifo", "a FIFO"), ("null", "a character device")])
def test_fs_read_and_write_refuse_what_is_not_a_regular_file_and_the_box_keeps_serving(fifo_box, name, kind):
    path = f"/workspace/{name}"

    async def go():
        async with ws_connect(fifo_box) as ws:
            s = Session(ws)
            # A supervisor that opened the FIFO would block its only loop: no reply would come (the
            # bounds are generous for a loaded machine; a blocked loop never answers).
            rd = await s.request("fs.read", timeout=10, id=21, path=path)
            wr = await s.request("fs.write", timeout=10, id=22, path=path, data="x")
            ap = await s.request("fs.write", timeout=10, id=23, path=path, data="x", append=True)
            st = await s.request("stats", timeout=10)
            return rd, wr, ap, st

    rd, wr, ap, st = run(go(), timeout=60)
    for r in (rd, wr, ap):
        assert r["ok"] is False and r["error"]["code"] == "not_a_file", r
        assert r["error"]["message"] == f"{path}: not a regular file: {kind}"
    assert st["ok"] is True
    assert "main" in st["procs"], st
    assert fifo_box.alive()
    # Nothing was written into the device or the FIFO, and they are still what they were.
    mode = os.lstat(fifo_box.workspace / name).st_mode
    assert stat.S_ISFIFO(mode) if name == "fifo" else stat.S_ISCHR(mode)


def test_cp_of_a_fifo_is_refused_at_once_both_ways(fifo_box, tmp_path):
    local = tmp_path / "local.txt"
    local.write_text("data\n")
    for args in ([f"{fifo_box.url}:/workspace/fifo", str(tmp_path / "down")],
                 [str(local), f"{fifo_box.url}:/workspace/fifo"]):
        t0 = time.monotonic()
        r = subprocess.run([str(CLI), "cp", "--token-file", str(fifo_box.token_file), *args],
                           capture_output=True, text=True, timeout=20)
        assert r.returncode != 0 and "/workspace/fifo: not a regular file: a FIFO" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 5
    assert fifo_box.alive()
    # Control: opening the agent's FIFO the old way (open, then check) blocks on this host.
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", f"open({str(fifo_box.workspace / 'fifo')!r}, 'rb')"], timeout=1)


# ---- item 12: the CLI's token dir without HOME ----

def cli_without_home(fake_tmp, script):
    """Runs `script` (sh) in a mount namespace of its own whose /tmp is `fake_tmp`, with HOME and
    XDG_STATE_HOME unset: the CLI's fallback is exercised without touching this host's /tmp."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_STATE_HOME")}
    env["CLI"] = str(CLI)
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount --bind {fake_tmp} /tmp && {script}"],
                          capture_output=True, text=True, timeout=30, env=env)


@needs_root
def test_cli_token_dir_without_home_refuses_a_planted_symlink(tmp_path):
    fake = tmp_path / "faketmp"
    fake.mkdir(mode=0o1777)
    victim = fake / "victim"
    victim.mkdir()
    (fake / f"sandboxer-{os.geteuid()}").symlink_to("/tmp/victim")
    r = cli_without_home(fake, '"$CLI" stats ws://127.0.0.1:9')
    assert r.returncode != 0
    assert f"/tmp/sandboxer-{os.geteuid()} is a symlink, not a directory: refusing to keep tokens there" in r.stderr, r.stderr
    assert list(victim.iterdir()) == []
    # Control: a plain mkdir -p of the old kind goes through the planted symlink.
    r = cli_without_home(fake, f"mkdir -p /tmp/sandboxer-{os.geteuid()}/tokens")
    assert r.returncode == 0 and (victim / "tokens").is_dir()


@needs_root
def test_cli_token_dir_without_home_refuses_another_users_dir_and_makes_its_own_0700(tmp_path):
    fake = tmp_path / "faketmp"
    fake.mkdir(mode=0o1777)
    mine = fake / f"sandboxer-{os.geteuid()}"
    mine.mkdir(mode=0o777)
    os.chown(mine, 4242, 4242)
    r = cli_without_home(fake, '"$CLI" stats ws://127.0.0.1:9')
    assert r.returncode != 0 and f"belongs to uid 4242, not to this user (uid {os.geteuid()})" in r.stderr, r.stderr
    assert list(mine.iterdir()) == []
    mine.rmdir()
    # With nothing planted: a directory of this user's own, 0700, tokens 0700 below it.
    r = cli_without_home(fake, '"$CLI" stats ws://127.0.0.1:9')
    assert "no token for ws://127.0.0.1:9" in r.stderr, r.stderr
    for d in (mine, mine / "tokens"):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


@needs_root
def test_a_state_dir_another_user_made_or_others_may_write_is_refused(tmp_path):
    # Another local user makes the state dir first (in a shared place such as /tmp) and plants
    # `branches` -> a directory of their choosing: root's supervisor made the branch's dirs there
    # (and, under a disk ceiling, its mounts and a workspace image) as root.
    victim = tmp_path / "victim"
    victim.mkdir()
    state = tmp_path / "shared"
    state.mkdir()
    os.chmod(state, 0o777)
    os.chown(state, 4242, 4242)
    (state / "branches").symlink_to(victim)
    cmd = [str(INIT), "--state-dir", str(state), "--", "true"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 125, r.stderr
    assert f"state dir {state} belongs to uid 4242, not to this user (uid 0)" in r.stderr, r.stderr
    os.chown(state, 0, 0)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 125, r.stderr
    assert f"state dir {state} is writable by others (mode 0777) and holds files" in r.stderr, r.stderr
    assert list(victim.iterdir()) == [] and stat.S_IMODE(os.stat(state).st_mode) == 0o777
    # As a container's PID 1 (its state dir is the one its runtime gave it) the state dir is not
    # checked; the link is still not followed (before 2026-12-07 the supervisor made the branch's
    # dirs through it there: victim/main).
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *cmd], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 125, r.stderr
    assert f"{state}/branches: a symlink, refused: Too many levels of symbolic links" in r.stderr, r.stderr
    assert list(victim.iterdir()) == []
    # An empty one of this user's (umask 002, or 0777 by hand) is narrowed, and used.
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o777)
    r = subprocess.run([str(INIT), "--state-dir", str(empty), "--", "true"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"state dir {empty} was writable by others (mode 0777): narrowed to 0755" in r.stderr, r.stderr
    assert stat.S_IMODE(os.stat(empty).st_mode) == 0o755


@needs_root
def test_a_state_dir_below_a_directory_others_may_write_is_refused():
    # The state dir is root's own, but a directory above it is one another user may write (not
    # sticky): they rename the state dir away while the box runs and put a link in its place, and
    # the supervisor, which names its files by the state dir's path, writes where the link points.
    # (In a directory of its own that uid 4242 may pass through: pytest's tmp_path is 0700.)
    base = pathlib.Path(tempfile.mkdtemp(prefix="state-ancestors-"))
    try:
        os.chmod(base, 0o711)
        ancestors_checked(base)
    finally:
        shutil.rmtree(base)


@needs_root
def test_a_directory_above_the_state_dir_writable_by_a_group_of_this_user_alone_passes():
    # As OpenSSH's secure_permissions asks of a group-writable file: a directory above the state
    # dir that its group may write passes where that group's one member is this user (root here,
    # by the group's member list or as the primary group of this user alone); with any other
    # member, or none, it is refused as one others may write. The user and group databases are
    # copies bound over /etc/passwd and /etc/group in a mount namespace of the test's own.
    base = pathlib.Path(tempfile.mkdtemp(prefix="state-group-"))
    try:
        os.chmod(base, 0o711)
        shared = base / "shared"
        shared.mkdir()
        os.chown(shared, 0, 4343)
        os.chmod(shared, 0o775)
        group, passwd = base / "group", base / "passwd"
        runs = []

        def start(members, primary=""):
            group.write_text(pathlib.Path("/etc/group").read_text() + f"sbx-solo:x:4343:{members}\n")
            passwd.write_text(pathlib.Path("/etc/passwd").read_text() + primary)
            state = shared / f"state{len(runs)}"
            runs.append(state)
            script = f'mount --bind {group} /etc/group && mount --bind {passwd} /etc/passwd && exec "$0" "$@"'
            return subprocess.run(["unshare", "--mount", "sh", "-c", script, str(INIT), "--state-dir", str(state),
                                   "--", "true"], capture_output=True, text=True, timeout=60)

        refused = f"its ancestor {shared} is writable by others (mode 0775) and not sticky"
        r = start("root")
        assert r.returncode == 0, r.stderr
        r = start("root,daemon")
        assert r.returncode == 125 and refused in r.stderr, r.stderr
        r = start("", "sbx-solo:x:4242:4343::/nonexistent:/usr/sbin/nologin\n")
        assert r.returncode == 125 and refused in r.stderr, r.stderr
        r = start("")  # no member at all (a group of setgid programs'): refused, as OpenSSH does
        assert r.returncode == 125 and refused in r.stderr, r.stderr
        r = start("", "sbx-root-too:x:0:4343::/nonexistent:/usr/sbin/nologin\n")  # this uid's primary group
        assert r.returncode == 0, r.stderr
    finally:
        shutil.rmtree(base)


def ancestors_checked(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    victim = tmp_path / "victim"
    (victim / "journal").mkdir(parents=True)
    state = shared / "state"
    # The agent waits, then writes more than a journal segment holds: the next one is made by path.
    agent = ["sh", "-c", "sleep 3; head -c 20000000 /dev/zero | tr '\\0' x | fold -w 4000"]
    cmd = [str(INIT), "--state-dir", str(state), "--", *agent]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 125, r.stderr
    assert (f"state dir {state}: its ancestor {shared} is writable by others (mode 0777) and not sticky: another "
            "user could swap the state dir for a link while the box runs") in r.stderr, r.stderr
    assert not state.exists()  # checked before it is made: a refused one is not left behind
    # Control: as a container's PID 1 nothing is checked; uid 4242 swaps the running box's state
    # dir for a link, and the supervisor's next journal segment is made where it points.
    box = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *cmd], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (state / "journal").is_dir() or not any(
                e["type"] == "proc.started" for e in read_journal(state)):
            assert time.monotonic() < deadline and box.poll() is None
            time.sleep(0.05)
        subprocess.run(["setpriv", "--reuid", "4242", "--regid", "4242", "--clear-groups", "sh", "-c",
                        f"mv {state} {shared}/moved && ln -s {victim} {state}"], check=True, timeout=30)
        assert box.wait(timeout=60) == 0, box.stderr.read()
    finally:
        if box.poll() is None:
            box.kill()
            box.wait()
    assert [p.name for p in (victim / "journal").iterdir() if p.name.endswith(".jsonl")], list(victim.rglob("*"))
    # A sticky one (as /tmp) passes: there only an entry's owner may rename it.
    os.chmod(shared, 0o1777)
    fresh = shared / "fresh"
    r = subprocess.run([str(INIT), "--state-dir", str(fresh), "--", "true"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    # Another user's, even not writable by others: they may rename what is in it.
    os.chmod(shared, 0o755)
    os.chown(shared, 4242, 4242)
    r = subprocess.run([str(INIT), "--state-dir", str(fresh), "--", "true"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 125 and f"state dir {fresh}: its ancestor {shared} belongs to uid 4242" in r.stderr, r.stderr


@needs_root
def test_archive_key_store_without_home_refuses_another_users_key(tmp_path):
    # The key a box signs with decides which archives criu restores: a key planted in the /tmp
    # fallback by another user must never be taken for ours.
    fake = tmp_path / "faketmp"
    fake.mkdir(mode=0o1777)
    home = fake / f"sandboxer-{os.geteuid()}"
    (home / "keys").mkdir(parents=True, mode=0o700)
    (home / "keys" / "signing.pem").write_text("an attacker's key\n")
    os.chmod(home, 0o700)
    run = '"$CLI" run --state-dir /tmp/state -- /bin/true'
    os.chown(home / "keys" / "signing.pem", 4242, 4242)
    r = cli_without_home(fake, run)
    assert r.returncode != 0 and "signing.pem: not a regular file of this user's alone" in r.stderr, r.stderr
    os.chown(home, 4242, 4242)
    r = cli_without_home(fake, run)
    assert r.returncode != 0 and f"belongs to uid 4242, not to this user (uid {os.geteuid()})" in r.stderr, r.stderr
    # Control: with nothing planted, the store is made 0700 with a 0600 key of ours, and the box runs.
    shutil.rmtree(home)
    r = cli_without_home(fake, run)
    assert r.returncode == 0, r.stderr
    for d in (home, home / "keys"):
        st = os.lstat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    st = os.lstat(home / "keys" / "signing.pem")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()


# ---- fs.rename through a directory the agent keeps swapping for a symlink ----

FLIPPER = """
import os, sys, time
victim = sys.argv[1]
os.makedirs("/workspace/p", exist_ok=True)
open("/workspace/p/keep", "w").write("agent file\\n")
open("/workspace/ready", "w").close()
while True:  # /workspace/p: the agent's directory, then a symlink to the host's victim dir, ...
    try:
        os.rename("/workspace/p", "/workspace/p.d")
        os.symlink(victim, "/workspace/p")
        time.sleep(0.0005)
        os.unlink("/workspace/p")
        os.rename("/workspace/p.d", "/workspace/p")
        time.sleep(0.0005)
    except OSError:
        pass
"""


@contextlib.contextmanager
def flipping_box(tmp_path, victim):
    """A box whose agent runs FLIPPER against `victim`, once it flips."""
    (tmp_path / "b").mkdir()
    with WsBox(tmp_path / "b", [sys.executable, "-c", FLIPPER, str(victim)],
               extra=["--set", "resources.grace=1s"]) as box:
        deadline = time.monotonic() + 15
        while not (box.workspace / "ready").exists():
            assert time.monotonic() < deadline, "the agent did not start flipping"
            time.sleep(0.05)
        yield box


def race(box, ask, check, enough):
    """Sends `ask(session, i)` (one request, i from 1) while the agent flips, until `enough` of
    them succeeded and another code came too (at most 4000), calling `check(i, reply)` after
    each. Both sides of the race must have been met: requests that went through in the agent's
    directory, and refusals through the symlink (or the name missing while it was away)."""
    async def go():
        codes = {}
        async with ws_connect(box) as wsc:
            s = Session(wsc)
            for i in range(1, 4001):
                r = await ask(s, i)
                code = "ok" if r["ok"] else r["error"]["code"]
                codes[code] = codes.get(code, 0) + 1
                check(i, r)
                if codes.get("ok", 0) >= enough and len(codes) >= 2:
                    break
        return codes
    codes = run(go(), 120)
    assert codes.get("ok", 0) > 0 and codes.get("path_escape", 0) + codes.get("not_found", 0) > 0, codes
    assert box.alive()


def by_path_reaches(step):
    """The control: `step()`, done by path on the host while the agent flips (each following
    whatever /workspace/p is at that instant), until it says it reached the victim; at most 4000."""
    for _ in range(4000):
        try:
            if step():
                return True
        except OSError:
            continue
    return False


def test_fs_rename_through_a_directory_swapped_for_a_symlink_never_moves_a_host_file(tmp_path):
    # The agent flips /workspace/p between its own directory and a symlink to a host directory,
    # while a client renames /workspace/p/keep out and back. The box resolves each end's parent
    # beneath the workspace and renames by the directory fd it opened: the host's file stays. The
    # control: the same renames by path, on the host, during the same flipping, move the host's
    # file at least once.
    victim = victim_dir(tmp_path)
    with flipping_box(tmp_path, victim) as box:
        ws = box.workspace
        out = [False]  # the agent's file is at /workspace/got

        async def ask(s, i):
            ends = ("/workspace/got", "/workspace/p/keep") if out[0] else ("/workspace/p/keep", "/workspace/got")
            r = await s.request("fs.rename", **{"from": ends[0], "to": ends[1]})
            out[0] ^= r["ok"]
            return r

        def check(i, r):
            assert (victim / "keep").read_text() == "host file\n", (i, r)
        race(box, ask, check, 10)

        # Once the agent's own file has gone to naive, the next rename that succeeds went through
        # the symlink; the host's file is put back.
        def step():
            os.rename(ws / "p" / "keep", ws / "naive")
            if (victim / "keep").exists():
                return False
            os.rename(ws / "naive", victim / "keep")
            return True
        assert by_path_reaches(step), "the path-based rename never went through the symlink: the race was not met"
    assert (victim / "keep").read_text() == "host file\n"


# ---- fs.chmod and fs.symlink through a directory the agent keeps swapping for a symlink ----


def test_fs_chmod_and_symlink_through_a_swapped_directory_never_reach_the_host(tmp_path):
    # As above, with the two ops that change an entry in place: the client sets the mode of
    # /workspace/p/keep and makes symlinks in /workspace/p while the agent flips p. Each resolves
    # beneath the workspace (fs.chmod sets the mode through the fd it resolved): the host's file
    # keeps its mode and no link appears beside it. The control: chmod by path on the host, during
    # the same flipping, changes the host file's mode at least once.
    victim = victim_dir(tmp_path)
    (victim / "keep").chmod(0o644)
    with flipping_box(tmp_path, victim) as box:
        ws = box.workspace

        async def ask(s, i):
            if i % 2:
                return await s.request("fs.chmod", path="/workspace/p/keep", mode=0o600 if i % 4 == 1 else 0o640)
            return await s.request("fs.symlink", path=f"/workspace/p/l{i}", target="/etc/passwd")

        def check(i, r):
            assert stat.S_IMODE((victim / "keep").stat().st_mode) == 0o644, (i, r)
            assert sorted(p.name for p in victim.iterdir()) == ["keep"], (i, r)
        race(box, ask, check, 20)

        def step():
            os.chmod(ws / "p" / "keep", 0o600)
            if stat.S_IMODE((victim / "keep").stat().st_mode) != 0o600:
                return False
            (victim / "keep").chmod(0o644)
            return True
        assert by_path_reaches(step), "the path-based chmod never went through the symlink: the race was not met"
    assert stat.S_IMODE((victim / "keep").stat().st_mode) == 0o644


# ---- a box whose listing names one entry twice: a symlink to a host file, then a file ----


@contextlib.contextmanager
def lying_box(victim):
    """A WebSocket server on 127.0.0.1 that answers as a box whose /workspace/t lists `x` twice,
    as a listing read while the agent renames can: first a symlink to `victim`, then a file of 5
    bytes, which fs.read of /workspace/t/x gives. Yields its URL."""
    import asyncio
    import json
    import struct
    import threading
    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    async def handler(ws):
        with contextlib.suppress(ConnectionClosed):
            await answer(ws)

    async def answer(ws):
        async for text in ws:
            if not isinstance(text, str):
                continue
            req = json.loads(text)
            rid, op = req.get("id"), req.get("op")
            if op == "fs.stat":
                await ws.send(json.dumps({"id": rid, "ok": True, "type": "dir", "mode": 0o755}))
            elif op == "fs.list":
                await ws.send(json.dumps({"id": rid, "ok": True, "entries": [
                    {"name": "x", "type": "symlink", "size": 10, "mode": 0o777, "target": str(victim)},
                    {"name": "x", "type": "file", "size": 5, "mode": 0o644}]}))
            elif op == "fs.read":
                await ws.send(json.dumps({"id": rid, "ok": True, "size": 5, "length": 5}))
                await ws.send(struct.pack("<IQB", rid, 0, 1) + b"owned")
            else:
                await ws.send(json.dumps({"id": rid, "ok": False, "error": {"code": "bad_request", "message": op}}))

    ready, port, stop = threading.Event(), [], []

    def run_server():
        async def main():
            async with serve(handler, "127.0.0.1", 0, subprotocols=["sandboxer.v1"]) as srv:
                port.append(srv.sockets[0].getsockname()[1])
                stop.append((asyncio.get_running_loop(), asyncio.Event()))
                ready.set()
                await stop[0][1].wait()
        asyncio.run(main())
    t = threading.Thread(target=run_server, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield f"ws://127.0.0.1:{port[0]}"
    finally:
        loop, ev = stop[0]
        loop.call_soon_threadsafe(ev.set)
        t.join(10)


def test_cp_r_out_of_a_box_that_lists_a_name_twice_writes_no_host_file_through_its_symlink(tmp_path):
    # cp -r makes a box's symlink here as a symlink; a listing that then names the same entry as a
    # file must not have the file's bytes written through that link. The entry listed twice is
    # skipped and named, and each file of a tree is opened new (O_EXCL|O_NOFOLLOW) besides. The
    # control: a write by path to what cp -r made reaches the host file.
    victim = tmp_path / "victim.txt"
    victim.write_text("host file\n")
    token = tmp_path / "token"
    token.write_text("t")
    out = tmp_path / "out"
    with lying_box(victim) as url:
        r = subprocess.run([str(CLI), "cp", "-r", f"{url}:/workspace/t", str(out), "--token-file", str(token)],
                           capture_output=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert b"skipped /workspace/t/x: listed twice (it changed while it was listed)" in r.stderr, r.stderr
    assert victim.read_text() == "host file\n"
    assert os.readlink(out / "x") == str(victim)
    # The control.
    (out / "x").write_text("owned")
    assert victim.read_text() == "owned"
