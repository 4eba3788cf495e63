"""`sandboxer send`: a snapshot out of one box and into others over the box API, read once (issue
17). The archive reaches a target's store only whole and hashing to its id: a stream cut or
altered on the way leaves every target as it was, and the source untouched.

`sandboxer fork URL --to URL...` and `sandboxer migrate URL --to URL` stand on the same relay:
boxes some host started idle (what the Modal, Daytona and Kubernetes shims start) become copies
of the source's agent, each named where it came from in its restore.done."""
import asyncio
import base64
import contextlib
import os
import signal
import socket
import subprocess
import time

import pytest

from sbxtest import CLI, FrameProxy, Session, WsBox, make_tls, output_of, silent_websocket_server, ws_connect

COUNTER = ("import time\n"
           "n = 0\n"
           "while True:\n"
           "    n += 1\n"
           "    print(n, flush=True)\n"
           "    time.sleep(0.1)\n")


def numbers(box, branch="main"):
    text = output_of(box.read_events(), branch).decode(errors="replace")
    return [int(x) for x in text[:text.rfind("\n") + 1].split()]


def sandboxer(*args, env=None, timeout=120):
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def source_and_idle_boxes(tmp_path, n, agent=COUNTER):
    """Box A counting in memory, and `n` idle boxes (no agent), each with its own token."""
    with contextlib.ExitStack() as stack:
        (tmp_path / "a").mkdir()
        a = stack.enter_context(WsBox(tmp_path / "a", ["python3", "-c", agent],
                                      extra=["--set", "resources.grace=1s"]))
        idle = []
        for i in range(n):
            (tmp_path / f"t{i}").mkdir()
            idle.append(stack.enter_context(WsBox(tmp_path / f"t{i}", [],
                                                  extra=["--idle", "--set", "resources.grace=1s"])))
        yield a, idle


def checkpoint(a):
    time.sleep(0.8)
    r = sandboxer("checkpoint", a.url, "--token-file", str(a.token_file))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def send(a, snap, targets, env=None, source_url=None):
    args = ["send", source_url or a.url, snap, "--token-file", str(a.token_file)]
    for t in targets:
        args += ["--to", t.url, "--to-token-file", str(t.token_file)]
    return sandboxer(*args, env=env)


def to_args(targets):
    args = []
    for t in targets:
        args += ["--to", t.url, "--to-token-file", str(t.token_file)]
    return args


def wait_numbers(box, n=3, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(numbers(box)) < n:
        time.sleep(0.1)
    return numbers(box)


def snapshots_of(box):
    return {p.name for p in (box.state / "snapshots").iterdir()} if (box.state / "snapshots").exists() else set()


def test_send_moves_a_live_snapshot_into_two_idle_boxes_which_continue_the_agent(tmp_path):
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "cli-state"))
    with source_and_idle_boxes(tmp_path, 2) as (a, targets):
        snap = checkpoint(a)
        at_checkpoint = max(numbers(a))
        r = send(a, snap, targets, env=env)
        assert r.returncode == 0, r.stderr
        assert sorted(r.stdout.split("\n")[:2]) == sorted(f"{t.url} {snap}" for t in targets), r.stdout
        # Nothing of the archive stays on this machine.
        assert not [p for p in (tmp_path / "cli-state").rglob("*") if p.is_file()]
        a_box = next(e for e in a.read_events() if e["type"] == "box.started")["box"]
        for i, t in enumerate(targets):
            (imported,) = [e for e in t.read_events() if e["type"] == "snapshot.imported"]
            t_box = next(e for e in t.read_events() if e["type"] == "box.started")["box"]
            assert (imported["snapshot"], imported["from_box"], imported["box"]) == (snap, a_box, t_box), imported
            rr = sandboxer("restore", t.url, snap, "--index", str(i), "--token-file", str(t.token_file))
            assert rr.returncode == 0, rr.stderr
        for i, t in enumerate(targets):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(numbers(t)) < 3:
                time.sleep(0.1)
            seen = numbers(t)
            # Each continues A's counter from memory, as its copy i.
            assert seen and 1 < seen[0] <= at_checkpoint + 2, (i, seen[:3], at_checkpoint)
            done = next(e for e in t.read_events() if e["type"] == "restore.done")
            assert (done["index"], done["mode"], done["snapshot"]) == (i, "live", snap)
        n = max(numbers(a))
        time.sleep(0.5)
        assert a.alive() and max(numbers(a)) > n


@pytest.mark.parametrize("how", ["cut", "flip", "drop"])
def test_a_stream_cut_or_altered_on_the_way_is_imported_by_no_target_and_leaves_the_source(tmp_path, how):
    """A cut stream is stopped at the relay (its size); an altered one names the right snapshot
    (the manifest is intact) and every target refuses it as it checks each entry, keeping nothing;
    a frame left out is seen at the relay (the next one does not start where the last ended)."""
    with source_and_idle_boxes(tmp_path, 2) as (a, targets):
        snap = checkpoint(a)
        before = [snapshots_of(t) for t in targets]
        whole = tmp_path / "whole.tar.zst"
        assert sandboxer("export", a.url, snap, str(whole), "--token-file", str(a.token_file)).returncode == 0
        size = whole.stat().st_size
        proxy = FrameProxy(a.port, cut=size // 2 if how == "cut" else None, flip=how == "flip",
                           drop=2 if how == "drop" else None)
        try:
            r = send(a, snap, targets, source_url=proxy.url)
        finally:
            proxy.close()
        assert proxy.acted, "the proxy never reached the archive's frames"
        assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
        if how == "cut":
            assert f"of {size} bytes" in r.stderr and "closed after" in r.stderr, r.stderr
        elif how == "drop":
            assert "was due (bad_frame)" in r.stderr, r.stderr
        else:
            # Where the flip lands decides which check sees it first: an entry's sha256, or zstd.
            for t in targets:
                (line,) = [x for x in r.stderr.splitlines() if f"import into {t.url}: the archive is refused: " in x]
                assert "corrupted" in line, r.stderr
        # No target imported anything, and none keeps a partial upload; all still serve.
        time.sleep(0.5)
        for t, had in zip(targets, before):
            assert snapshots_of(t) == had
            assert not any(e["type"] == "snapshot.imported" for e in t.read_events())
            assert t.alive()
        # The source is untouched: it still has the snapshot and counts on.
        assert f"{snap}.json" in snapshots_of(a) and a.alive()
        n = max(numbers(a))
        time.sleep(0.4)
        assert max(numbers(a)) > n
        # Control: the same send straight from the source reaches both.
        ok = send(a, snap, targets)
        assert ok.returncode == 0, ok.stderr
        for t in targets:
            assert any(e["type"] == "snapshot.imported" and e["snapshot"] == snap for e in t.read_events())


def test_send_says_what_was_wrong_and_one_bad_target_costs_only_itself(tmp_path):
    with source_and_idle_boxes(tmp_path, 1) as (a, (good,)):
        snap = checkpoint(a)
        r = sandboxer("send", a.url, "not-a-snapshot", "--to", good.url, "--token-file", str(a.token_file))
        # Neither an id nor the name of one of the source's snapshots.
        assert r.returncode == 1 and "is neither a snapshot id" in r.stderr and "(not_found)" in r.stderr, r.stderr
        r = sandboxer("send", a.url, snap, "--token-file", str(a.token_file))
        assert r.returncode == 2 and "no target" in r.stderr, r.stderr
        r = sandboxer("send", a.url, snap, "--to", good.url, "--to", good.url, "--token-file", str(a.token_file),
                      "--to-token-file", str(good.token_file), "--to-token-file", str(good.token_file),
                      "--to-token-file", str(good.token_file))
        assert r.returncode == 2 and "3 --to-token-file for 2 --to" in r.stderr, r.stderr
        r = send(a, "s-0000000000000000", [good])
        assert r.returncode == 1 and "no snapshot" in r.stderr, r.stderr
        assert not any(e["type"] == "snapshot.imported" for e in good.read_events())
        # A target that does not answer fails alone: the other gets the snapshot.
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"ws://127.0.0.1:{closed.getsockname()[1]}"
        r = sandboxer("send", a.url, snap, "--token-file", str(a.token_file), "--to", dead, "--to", good.url,
                      "--to-token-file", str(good.token_file))
        assert r.returncode == 1 and f"import into {dead}" in r.stderr, r.stderr
        assert r.stdout == f"{good.url} {snap}\n", r.stdout
        assert any(e["type"] == "snapshot.imported" and e["snapshot"] == snap for e in good.read_events())
        assert a.alive() and good.alive()


def test_send_over_wss_only_into_a_box_whose_certificate_verifies(tmp_path):
    """The relay's connections are TLS for wss:// URLs, each verified against the system's CAs
    (SSL_CERT_FILE here): a target whose CA is not trusted gets nothing, and the source is not
    held back by it; trusted, the same send arrives."""
    cas = []
    for name in ("a", "t"):
        (tmp_path / f"tls-{name}").mkdir()
        cas.append(make_tls(tmp_path / f"tls-{name}", names=("127.0.0.1",)))
    (tmp_path / "a").mkdir()
    (tmp_path / "t").mkdir()
    certs = lambda tls: ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--set", "resources.grace=1s"]  # noqa: E731
    with WsBox(tmp_path / "a", ["python3", "-c", COUNTER], extra=certs(cas[0])) as a, \
            WsBox(tmp_path / "t", [], extra=["--idle", *certs(cas[1])]) as t:
        src, dst = f"wss://127.0.0.1:{a.port}", f"wss://127.0.0.1:{t.port}"
        only_a = dict(os.environ, SSL_CERT_FILE=str(cas[0].ca))
        both = tmp_path / "both.pem"
        both.write_bytes(cas[0].ca.read_bytes() + cas[1].ca.read_bytes())
        time.sleep(0.8)
        c = sandboxer("checkpoint", src, "--token-file", str(a.token_file), env=only_a)
        assert c.returncode == 0, c.stderr
        snap = c.stdout.strip().splitlines()[-1]
        args = ["send", src, snap, "--token-file", str(a.token_file), "--to", dst, "--to-token-file", str(t.token_file)]
        # The control: the target's CA is not trusted.
        r = sandboxer(*args, env=only_a)
        assert r.returncode == 1 and f"import into {dst}" in r.stderr, r.stderr
        assert "certificate verify failed" in r.stderr and "export" not in r.stderr, r.stderr
        assert not any(e["type"] == "snapshot.imported" for e in t.read_events())
        ok = sandboxer(*args, env=dict(os.environ, SSL_CERT_FILE=str(both)))
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout == f"{dst} {snap}\n", ok.stdout
        assert any(e["type"] == "snapshot.imported" and e["snapshot"] == snap for e in t.read_events())
        assert a.alive() and t.alive()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_send_waiting_on_a_silent_source_ends_at_an_interrupt_and_leaves_the_target(tmp_path, sig):
    """A source that never answers snapshot.export (a server that completes the handshake and
    then reads forever): SIGINT or SIGTERM ends the send, naming the interrupt, and the target
    has nothing."""
    srv = silent_websocket_server()
    (tmp_path / "t").mkdir()
    with WsBox(tmp_path / "t", [], extra=["--idle", "--set", "resources.grace=1s"]) as t:
        token = tmp_path / "token"
        token.write_text("x" * 32)
        p = subprocess.Popen([str(CLI), "send", f"ws://127.0.0.1:{srv.getsockname()[1]}", "s-0123456789abcdef",
                              "--token-file", str(token), "--to", t.url, "--to-token-file", str(t.token_file),
                              "--whole"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(0.8)
        assert p.poll() is None  # waiting for the export's reply
        p.send_signal(sig)
        out, err = p.communicate(timeout=10)
        srv.close()
        assert p.returncode == 1 and out == b"", (out, err)
        assert b": interrupted (interrupted)" in err, err
        assert not any(e["type"] == "snapshot.imported" for e in t.read_events())
        assert t.alive()


def test_fork_into_idle_boxes_makes_each_a_live_copy_that_names_its_source(tmp_path):
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "cli-state"))
    with source_and_idle_boxes(tmp_path, 2) as (a, targets):
        snap = checkpoint(a)
        at_checkpoint = max(numbers(a))
        r = sandboxer("fork", a.url, "--snapshot", snap, "--token-file", str(a.token_file), *to_args(targets),
                      env=env)
        assert r.returncode == 0, r.stderr
        # One line per copy, in the order given: main <URL>.
        assert r.stdout.splitlines() == [f"main {t.url}" for t in targets], r.stdout
        a_box = next(e for e in a.read_events() if e["type"] == "box.started")["box"]
        for i, t in enumerate(targets):
            seen = wait_numbers(t)
            assert seen and 1 < seen[0] <= at_checkpoint + 2, (i, seen[:3], at_checkpoint)
            done = next(e for e in t.read_events() if e["type"] == "restore.done")
            assert (done["index"], done["mode"], done["snapshot"]) == (i, "live", snap), done
            # Where it came from: the URL the CLI read it from, and the box that took it.
            assert (done["from"], done["parent_box"]) == (a.url, a_box), done
        n = max(numbers(a))
        time.sleep(0.5)
        assert a.alive() and max(numbers(a)) > n
        # A box that has become a copy is no longer idle: a second fork into it is refused.
        again = sandboxer("fork", a.url, "--snapshot", snap, "--token-file", str(a.token_file), *to_args(targets[:1]))
        assert again.returncode == 1 and "not_idle" in again.stderr, again.stderr


def test_fork_into_boxes_over_a_cut_stream_restores_nothing_and_the_source_goes_on(tmp_path):
    with source_and_idle_boxes(tmp_path, 2) as (a, targets):
        snap = checkpoint(a)
        whole = tmp_path / "whole.tar.zst"
        assert sandboxer("export", a.url, snap, str(whole), "--token-file", str(a.token_file)).returncode == 0
        proxy = FrameProxy(a.port, cut=whole.stat().st_size // 2)
        try:
            r = sandboxer("fork", proxy.url, "--snapshot", snap, "--token-file", str(a.token_file), *to_args(targets))
        finally:
            proxy.close()
        assert proxy.acted
        assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
        assert "left as they are" in r.stderr and "closed after" in r.stderr, r.stderr
        time.sleep(0.5)
        for t in targets:
            assert not any(e["type"] in ("snapshot.imported", "restore.done") for e in t.read_events())
            assert t.alive() and not numbers(t)
        n = max(numbers(a))
        time.sleep(0.4)
        assert a.alive() and max(numbers(a)) > n
        # Control: the same fork straight from the source makes both copies.
        ok = sandboxer("fork", a.url, "--snapshot", snap, "--token-file", str(a.token_file), *to_args(targets))
        assert ok.returncode == 0, ok.stderr
        for t in targets:
            assert wait_numbers(t), t.stderr()


def test_migrate_into_an_idle_box_continues_the_agent_there_and_ends_the_original(tmp_path):
    with source_and_idle_boxes(tmp_path, 1) as (a, (t,)):
        time.sleep(0.8)
        r = sandboxer("migrate", a.url, "--token-file", str(a.token_file), *to_args([t]))
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[-1] == t.url, r.stdout
        # The original ends as a hibernated box does: exit 0, its last line the one before the copy's first.
        assert a.proc.wait(timeout=20) == 0, a.stderr()
        last = max(numbers(a))
        seen = wait_numbers(t)
        assert seen[0] == last + 1, (last, seen[:3])
        done = next(e for e in t.read_events() if e["type"] == "restore.done")
        assert (done["from"], done["index"], done["mode"]) == (a.url, 0, "live"), done


def test_migrate_into_a_box_that_refuses_leaves_the_original_counting(tmp_path):
    with source_and_idle_boxes(tmp_path, 0) as (a, _):
        (tmp_path / "busy").mkdir()
        with WsBox(tmp_path / "busy", ["sleep", "600"], extra=["--set", "resources.grace=1s"]) as busy:
            time.sleep(0.5)
            r = sandboxer("migrate", a.url, "--token-file", str(a.token_file), *to_args([busy]))
            assert r.returncode == 1, r.stderr
            assert "its agent goes on there" in r.stderr and "not_idle" in r.stderr, r.stderr
            assert f"the box at {busy.url} is left as it is" in r.stderr, r.stderr
            n = max(numbers(a))
            time.sleep(0.5)
            assert a.alive() and max(numbers(a)) > n and busy.alive()


def test_fork_and_migrate_onto_boxes_say_what_was_wrong(tmp_path):
    with source_and_idle_boxes(tmp_path, 1) as (a, (t,)):
        tf = ["--token-file", str(a.token_file)]
        snap = checkpoint(a)
        r = sandboxer("fork", a.url, "--snapshot", snap, "-n", "2", *tf, *to_args([t]))
        assert r.returncode == 2 and "no --host, -n or --json" in r.stderr, r.stderr
        r = sandboxer("fork", a.url, "--snapshot", snap, *tf, "--to", "http://x:1")
        assert r.returncode == 2 and "--to http://x:1" in r.stderr, r.stderr
        r = sandboxer("fork", a.url, "--snapshot", snap, *tf, "--to-token-file", str(t.token_file))
        assert r.returncode == 2 and "only with --to" in r.stderr, r.stderr
        r = sandboxer("migrate", a.url, *tf, "--to", "ftp://x")
        assert r.returncode == 2 and "ws:// or wss://" in r.stderr, r.stderr
        r = sandboxer("migrate", a.url, *tf, *to_args([t, t]))
        assert r.returncode == 2 and "one target" in r.stderr, r.stderr
        # restore's `from` is for an idle box's restore only, and printable.
        r = request_of(t, {"op": "restore", "snapshot": snap, "from": "x"})
        assert r["error"]["code"] == "bad_request" and "only with index" in r["error"]["message"], r
        r = request_of(t, {"op": "restore", "snapshot": snap, "index": 0, "from": "a\nb"})
        assert r["error"]["code"] == "bad_request" and "control character" in r["error"]["message"], r
        assert t.alive() and a.alive() and not numbers(t)


def request_of(box, req):
    async def go():
        async with ws_connect(box) as ws:
            return await Session(ws).request(req.pop("op"), timeout=30, **req)
    return asyncio.run(go())


def sent_bytes(stderr):
    line = next(l for l in stderr.splitlines() if l.startswith("sent "))
    return int(line.split("(", 1)[1].split(" bytes", 1)[0])


def test_send_and_fork_to_boxes_that_share_a_snapshot_move_only_what_it_lacks(tmp_path):
    # The agent holds 8 MiB it never changes: between two checkpoints only its counter moves.
    holder = "import os\nkeep = os.urandom(8 << 20)\n" + COUNTER
    with source_and_idle_boxes(tmp_path, 2, agent=holder) as (a, (t, u)):
        s1 = checkpoint(a)
        first = send(a, s1, [t, u])
        assert first.returncode == 0 and "delta" not in first.stderr, first.stderr
        whole = sent_bytes(first.stderr)
        assert whole > 8 << 20  # random bytes do not compress
        s2 = checkpoint(a)
        # Both targets have s1: asked, they lack only the chunks of s2 that s1 has not.
        r = send(a, s2, [t])
        assert r.returncode == 0 and "a delta of the " in r.stderr and "chunks the targets lack" in r.stderr, r.stderr
        assert r.stdout.split() == [t.url, s2]
        assert sent_bytes(r.stderr) < whole // 4, (sent_bytes(r.stderr), whole)
        imported = [e for e in t.read_events() if e["type"] == "snapshot.imported"]
        assert imported[-1]["snapshot"] == s2 and imported[-1]["base"] is None, imported[-1]
        # --whole: the archive itself, as before.
        w = sandboxer("send", a.url, s2, "--token-file", str(a.token_file), "--to", u.url, "--to-token-file",
                      str(u.token_file), "--whole")
        assert w.returncode == 0 and "delta" not in w.stderr and sent_bytes(w.stderr) > 8 << 20, w.stderr
        # A fork into a box that has s1 (and s2): a delta of the chunks of s3 it lacks, restored live.
        at = max(numbers(a))
        s3 = checkpoint(a)
        f = sandboxer("fork", a.url, "--snapshot", s3, "--token-file", str(a.token_file), *to_args([t]))
        assert f.returncode == 0 and "as a delta of the " in f.stderr, f.stderr
        seen = wait_numbers(t)
        assert seen and seen[0] > at, (seen[:3], at)
        done = next(e for e in t.read_events() if e["type"] == "restore.done")
        assert (done["mode"], done["snapshot"]) == ("live", s3), done


def test_a_box_that_shares_chunks_but_no_snapshot_with_the_source_is_sent_only_what_it_lacks(tmp_path):
    # The target has s1; the source has since deleted it, so no snapshot is common to both (a
    # base-delta cannot be had) and only the chunk negotiation keeps the unchanged 8 MiB at home.
    holder = "import os\nkeep = os.urandom(8 << 20)\n" + COUNTER
    with source_and_idle_boxes(tmp_path, 1, agent=holder) as (a, (t,)):
        s1 = checkpoint(a)
        first = send(a, s1, [t])
        assert first.returncode == 0, first.stderr
        whole = sent_bytes(first.stderr)
        assert request_of(a, {"op": "snapshot.delete", "snapshot": s1})["ok"]
        s2 = checkpoint(a)
        # Control: the archive itself is as large as before.
        w = sandboxer("send", a.url, s2, "--token-file", str(a.token_file), "--whole", *to_args([t]))
        assert w.returncode == 0 and sent_bytes(w.stderr) > whole // 2, w.stderr
        assert request_of(t, {"op": "snapshot.delete", "snapshot": s2})["ok"]
        r = send(a, s2, [t])
        assert r.returncode == 0 and "chunks the targets lack" in r.stderr, r.stderr
        assert sent_bytes(r.stderr) < whole // 4, (sent_bytes(r.stderr), whole)
        imported = [e for e in t.read_events() if e["type"] == "snapshot.imported"][-1]
        assert imported["snapshot"] == s2 and imported["base"] is None and imported["added_bytes"] < whole // 4
        # What it received restores: the target becomes a live copy of s2.
        assert request_of(t, {"op": "restore", "snapshot": s2, "index": 0})["ok"]
        done = next(e for e in t.read_events() if e["type"] == "restore.done")
        assert (done["mode"], done["snapshot"]) == ("live", s2), done


def test_the_chunk_negotiation_refuses_bad_requests_with_the_reason(tmp_path):
    with source_and_idle_boxes(tmp_path, 0) as (a, _):
        s1 = checkpoint(a)
        page = request_of(a, {"op": "snapshot.chunks", "snapshot": s1})
        assert page["ok"] and page["from"] == 0 and page["count"] == page["chunks"] > 0 and page["next"] is None, page
        raw = base64.b64decode(page["hashes"])
        assert len(raw) == 32 * page["count"]
        # The box has every chunk of its own snapshot, and none of a made-up one.
        mine = request_of(a, {"op": "snapshot.lacks", "hashes": page["hashes"]})
        assert mine["ok"] and mine["lacking"] == 0 and mine["count"] == page["count"], mine
        other = request_of(a, {"op": "snapshot.lacks", "hashes": base64.b64encode(b"\x01" * 64).decode()})
        assert other["ok"] and other["count"] == other["lacking"] == 2 and base64.b64decode(other["lacks"]) == b"\x03", \
            other
        for req, code, words in [
                ({"op": "snapshot.lacks", "hashes": "***"}, "bad_request", "not base64"),
                ({"op": "snapshot.lacks", "hashes": base64.b64encode(b"x" * 33).decode()}, "bad_request",
                 "not a whole number"),
                ({"op": "snapshot.lacks"}, "bad_request", "needs hashes"),
                ({"op": "snapshot.chunks", "snapshot": s1, "from": page["chunks"] + 1}, "bad_request", "past"),
                ({"op": "snapshot.chunks", "snapshot": "s-0000000000000000"}, "not_found", "no snapshot"),
                ({"op": "snapshot.export", "snapshot": s1, "lacks": "AA=="}, "bad_request", "need"),
                ({"op": "snapshot.export", "snapshot": s1, "lacks": "AA==", "base": s1}, "bad_request", "exclude")]:
            r = request_of(a, dict(req))
            assert not r["ok"] and r["error"]["code"] == code and words in r["error"]["message"], (req, r)
        assert a.alive() and numbers(a)


def test_a_snapshot_kept_as_chunks_goes_to_a_new_box_as_a_delta_of_every_chunk(tmp_path):
    # A box that keeps snapshots of its own stores them as chunks: to a box that has nothing, they
    # go as a delta of every chunk (the chunk files as they are) rather than an archive compressed
    # anew; the new box restores it live. Control: --whole still sends an archive.
    (tmp_path / "a").mkdir()
    (tmp_path / "t").mkdir()
    (tmp_path / "u").mkdir()
    with WsBox(tmp_path / "a", ["python3", "-c", COUNTER],
               extra=["--set", "checkpoint.on_stop=true", "--set", "resources.grace=1s"]) as a, \
            WsBox(tmp_path / "t", [], extra=["--idle"]) as t, WsBox(tmp_path / "u", [], extra=["--idle"]) as u:
        snap = checkpoint(a)
        assert (a.state / "snapshots" / f"{snap}.chunks").exists()
        r = send(a, snap, [t])
        assert r.returncode == 0, r.stderr
        line = next(l for l in r.stderr.splitlines() if l.startswith("sent "))
        n = line.split("a delta of the ", 1)[1].split(" ", 1)[0]
        assert f"a delta of the {n} of {n} chunks the targets lack" in line, line
        imported = [e for e in t.read_events() if e["type"] == "snapshot.imported"][-1]
        assert imported["snapshot"] == snap and imported["base"] is None, imported
        assert request_of(t, {"op": "restore", "snapshot": snap, "index": 0})["ok"]
        done = next(e for e in t.read_events() if e["type"] == "restore.done")
        assert (done["mode"], done["snapshot"]) == ("live", snap), done
        w = sandboxer("send", a.url, snap, "--token-file", str(a.token_file), "--whole", *to_args([u]))
        assert w.returncode == 0 and "delta" not in w.stderr, w.stderr
