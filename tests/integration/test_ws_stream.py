"""The event stream: every event after `since`, then live, with no gap and no duplicate, whatever
the clients do."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time


from sbxtest import INIT as INIT_BIN, PROBE, Session, WsBox, follow, run, ws_connect

HERE = os.path.dirname(__file__)

# Prints N JSON lines (each one a proc.message event, however the reads batch them), a last
# {"end": true} line, then waits. The end is a message, not an output marker: a read's
# proc.output event comes before the messages of the lines in it, so under load an output marker
# can carry a lower seq than the messages read with it.
TICKER = """
import os, sys, time
n = int(sys.argv[1])
for i in range(n):
    os.write(1, b'{"n": %d}\\n' % i)
    if i % 100 == 0:
        time.sleep(0.001)
os.write(1, b'{"end": true}\\n')
time.sleep(600)
"""


def is_end(e):
    if e["type"] == "proc.message":
        return e["message"].get("end") is True
    return e["type"] == "proc.output" and "END-OF-STREAM" in e.get("data", "")


async def read_until_end(box, since=0, timeout=120):
    # No keepalive pings: fifty clients in one Python process under a sanitizer build can leave a
    # pong queued behind megabytes of events longer than the library's 20 s ping timeout, which
    # closes a connection that is working; what is tested here is the stream, not keepalive.
    async with ws_connect(box, ping_interval=None) as ws:
        s = Session(ws)
        await s.request("subscribe", since=since)
        await s.wait_event(is_end, timeout)
        return s.events


def test_a_killed_client_resumes_with_since_and_sees_exactly_the_uninterrupted_sequence(tmp_path):
    with WsBox(tmp_path, [sys.executable, "-c", TICKER, "10000"]) as box:
        whole = run(read_until_end(box), 120)
        end = next(e["seq"] for e in whole if is_end(e))
        assert end >= 10000, end
        assert [e["seq"] for e in whole] == list(range(1, end + 1))

        # A client in its own process, SIGKILLed mid-stream.
        out = tmp_path / "killed.jsonl"
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "ws_reader.py"), box.url, box.token, "0", str(out)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 4000):
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        lines = out.read_text().splitlines()
        if lines and not lines[-1].endswith("}"):
            lines.pop()  # a torn last line: the process died mid-write
        got = [json.loads(l) for l in lines]
        assert 4000 <= len(got) < end
        rest = run(read_until_end(box, since=got[-1]["seq"]), 120)
        combined = got + [e for e in rest if e["seq"] <= end]
        assert combined == whole


def tail(path, n=64 << 10):
    """The last n bytes of a file, as text."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - n))
        return f.read().decode(errors="replace")


def until(pred, timeout, what):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_a_stuck_client_is_closed_with_4008_while_the_agent_finishes_and_resumes_to_every_seq(tmp_path):
    n = 200 * 1000 * 1000
    # The agent starts writing once the client is live (a client still replaying history reads
    # from disk at its own pace and is never "too slow"), through a gate file.
    agent = ["sh", "-c", "while [ ! -e /workspace/go ]; do sleep 0.01; done; "
             f"{PROBE} spew {n} && touch /workspace/done && echo END-OF-STREAM && exec sleep 600"]
    # A client that falls behind is served from the journal; only one that takes nothing for the
    # stall time (2 s here) is closed.
    env = {**os.environ, "SANDBOXER_WS_STALL_SECONDS": "2"}
    with WsBox(tmp_path, agent, extra=["--set", "resources.grace=1s"], env=env) as box:
        # The client is a process of its own, stopped (SIGSTOP) while the agent writes: it takes
        # nothing, whatever a client library would buffer or read by itself.
        out, closed = tmp_path / "reader.out", tmp_path / "reader.closed"
        reader = subprocess.Popen([sys.executable, os.path.join(HERE, "ws_reader.py"), box.url, box.token, "0",
                                   str(out), str(closed)])
        try:
            until(lambda: out.exists() and '"proc":"main"' in out.read_text() and
                     '"proc.started"' in out.read_text(), 30, "the reader saw proc.started")
            reader.send_signal(signal.SIGSTOP)
            (box.workspace / "go").touch()
            until(lambda: (box.workspace / "done").exists(), 120, "the agent finished while the client was stuck")
            # The stall clock starts only once the kernel's buffers are full, which on loopback
            # (tens of MiB) can be seconds after the agent is done: wait for the server to say it.
            until(lambda: "closing with 4008" in box.stderr_path.read_text(errors="replace"), 60, "the server saw the client take nothing")
            # The agent is done; now the client reads again: what was sent, then the close.
            reader.send_signal(signal.SIGCONT)
            reader.wait(60)
        finally:
            reader.kill()
            reader.wait()
        with_close = json.loads(closed.read_text())
        assert with_close["code"] == 4008, with_close
        assert with_close["reason"].startswith("resume_after=")
        resume_after = int(with_close["reason"].split("=")[1])
        seen = [json.loads(line) for line in out.read_text().splitlines()]
        # Everything up to resume_after was handed to the socket; a client library may still drop
        # what it had queued when the close came, so a client resumes from the last seq it saw
        # itself (never later than resume_after).
        assert seen[-1]["seq"] <= resume_after
        assert not any(is_end(e) for e in seen)

        async def go():
            async with ws_connect(box) as ws:
                s2 = Session(ws)
                await s2.request("subscribe", since=seen[-1]["seq"])
                await s2.wait_event(is_end, 120)
                return s2.events
        rest = run(go(), 240)
        seqs = [e["seq"] for e in seen + rest]
        assert seqs == list(range(1, seqs[-1] + 1))
        total = sum(len(e.get("data", "")) for e in seen + rest
                    if e["type"] == "proc.output" and e.get("stream") == "stdout")
        assert total == n + len("END-OF-STREAM\n")


def test_a_client_reading_slowly_is_not_closed_as_one_that_takes_nothing(tmp_path):
    # A client on a slow link takes a few KB at a time: the server's kernel holds megabytes for it,
    # so the server hands it no new frame for many seconds while it reads all the while. It is not
    # a client that takes nothing (4008), and it gets every event once, in order.
    n = 40 << 20
    agent = ["sh", "-c", f"{PROBE} spew {n} && echo END-OF-STREAM && exec sleep 600"]
    env = {**os.environ, "SANDBOXER_WS_STALL_SECONDS": "2"}
    with WsBox(tmp_path, agent, extra=["--set", "resources.grace=1s"], env=env) as box:
        until(lambda: "END-OF-STREAM" in tail(box.events), 60, "the agent wrote its output")
        out = tmp_path / "slow.json"
        # 64 KB/s for three times the stall time, then as fast as it can.
        subprocess.run([sys.executable, os.path.join(HERE, "ws_slow_reader.py"), str(box.port), box.token, "6",
                        str(64 << 10), str(out)], timeout=180, check=True)
        got = json.loads(out.read_text())
    assert got["close"] is None, got["close"]
    assert got["end"]
    assert got["seqs"] == list(range(1, got["seqs"][-1] + 1))
    # It read while slow, and far less than there was: the server owed it frames all that time.
    assert 0 < got["slow_bytes"] < n // 4, got["slow_bytes"]


def test_fifty_clients_at_once_each_see_the_whole_stream(tmp_path):
    with WsBox(tmp_path, [sys.executable, "-c", TICKER, "2000"]) as box:
        async def go():
            return await asyncio.gather(*(read_until_end(box) for _ in range(50)))
        results = run(go(), 120)
        first = results[0]
        assert [e["seq"] for e in first] == list(range(1, len(first) + 1))
        for r in results[1:]:
            assert r == first


def test_subscribe_by_branch_filters_and_since_skips(tmp_path):
    with WsBox(tmp_path, [sys.executable, "-c", TICKER, "10"]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                r = await s.request("subscribe", since=2, branch="main")
                assert r["ok"]
                await s.wait_event(is_end)
                assert s.events[0]["seq"] == 3
                assert all(e["branch"] == "main" for e in s.events)
                bad = await s.request("subscribe", branch="nope")
                assert bad["error"]["code"] == "no_such_branch"
        run(go(), 60)


def started_seq(s):
    return next(e["seq"] for e in s.events if e["type"] == "proc.started")


def test_metrics_events_arrive_at_the_cadence(tmp_path):
    with WsBox(tmp_path, ["sleep", "60"], metrics="200ms") as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                await s.request("subscribe", since=0)
                # A tick before the agent has started lists no procs (a loaded host can get
                # there first): the metrics after proc.started must name it.
                await s.wait_event(lambda e: e["type"] == "proc.started", 10)
                e = await s.wait_event(lambda e: e["type"] == "metrics" and e["seq"] > started_seq(s), 10)
                assert e["box"]["pids"] >= 1 and e["box"]["memory"] > 0
                assert "main" in e["procs"]
        run(go(), 30)


def test_the_journal_disk_cap_drops_the_oldest_segments_and_says_so(tmp_path):
    n = 40 * 1000 * 1000  # three 16 MiB segments at least
    agent = ["sh", "-c", f"{PROBE} spew {n} && echo END-OF-STREAM && exec sleep 600"]
    with WsBox(tmp_path, agent, extra=["--set", "journal.disk_cap=64K"]) as box:
        async def go():
            live = await follow(box, is_end)
            if not any(e["type"] == "journal.truncated" for e in live):
                live += await follow(box, lambda e: e["type"] == "journal.truncated", since=live[-1]["seq"], timeout=30)
            # A late client asking for everything gets what is kept: from the first kept seq on.
            late = await follow(box, lambda e: e["type"] == "journal.truncated")
            return live, late
        live, late = run(go(), 180)
        trunc = next(e for e in live if e["type"] == "journal.truncated")
        assert trunc["first_seq"] > 1 and trunc["cap"] == 64 * 1024 and trunc["branch"] == "main"
        assert late[0]["seq"] >= trunc["first_seq"] > 1
        seqs = [e["seq"] for e in late]
        assert seqs == sorted(set(seqs))


def test_a_bad_journal_cap_is_refused_naming_the_field(tmp_path):
    r = subprocess.run([str(INIT_BIN), "--state-dir", str(tmp_path / "s"), "--set", "journal.disk_cap=lots", "--", "true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and "journal.disk_cap" in r.stderr
