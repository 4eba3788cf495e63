"""The agent channel: whoami, custom events, and clear refusals of bad requests."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from sbxtest import INIT, ROOT, Session, WsBox, read_journal, run, ws_connect

SDK = ROOT / "sdk" / "python" / "sandboxer"

AGENT = r'''
import json, os, sys
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
req, rep = (int(x) for x in os.environ["SANDBOXER_CHANNEL_FD"].split(","))
ch = agent.Channel()
out = {"whoami": ch.whoami(), "file": agent.branch_info()}
# Raw bad requests: each gets an error reply naming what was wrong.
def raw(line):
    os.write(req, line)
    return ch._read_line()
out["garbage"] = raw(b"this is not json\n")
out["no_op"] = raw(b'{"id": 90}\n')
out["unknown"] = raw(b'{"id": 91, "op": "launch_missiles"}\n')
out["bad_event"] = raw(b'{"id": 92, "op": "event", "event": 5}\n')
out["bad_fork"] = raw(b'{"id": 93, "op": "fork", "n": 0}\n')
out["seq"] = ch.event("agent.note", text="hello", seq=1, box="forged")["seq"]
out["after"] = ch.whoami()["branch"]
print(json.dumps(out), flush=True)
'''


def test_the_channel_answers_who_and_refuses_bad_requests(tmp_path):
    s = tmp_path / "s"
    r = subprocess.run([str(INIT), "--state-dir", str(s), "--env", "SBX_AGENT_SDK", "--", sys.executable, "-c", AGENT],
                       capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, SBX_AGENT_SDK=str(SDK)))
    assert r.returncode == 0, r.stderr
    ev = read_journal(s)
    out = next(e["message"] for e in ev if e["type"] == "proc.message")
    box = next(e for e in ev if e["type"] == "box.started")["box"]
    assert out["whoami"] == {"box": box, "branch": "main", "mode": "original", "index": 0, "parent": None,
                             "snapshot": None}
    assert out["file"] == out["whoami"]
    # The server's reply shape (tests/protocol/channel.json): the id, null when unreadable.
    assert out["garbage"]["ok"] is False and out["garbage"]["error"]["code"] == "bad_json"
    assert out["garbage"]["id"] is None
    assert out["no_op"] == {"id": 90, "ok": False, "error": {"code": "bad_request", "message": "field op: missing"}}
    assert out["unknown"]["error"]["code"] == "unknown_op" and "launch_missiles" in out["unknown"]["error"]["message"]
    assert out["bad_event"]["error"]["code"] == "bad_request" and out["bad_event"]["id"] == 92
    assert out["bad_fork"]["error"]["code"] == "bad_request" and out["bad_fork"]["id"] == 93
    assert out["after"] == "main"  # the channel still works after every refusal
    note = next(e for e in ev if e["type"] == "agent.note")
    assert note["seq"] == out["seq"] and note["text"] == "hello" and note["box"] == box
    assert note["branch"] == "main" and note["proc"] == "main"


def test_an_idle_box_waits_without_an_agent_and_stops_on_term(tmp_path):
    s = tmp_path / "s"
    p = subprocess.Popen([str(INIT), "--state-dir", str(s), "--idle"], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1)
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    ev = read_journal(s)
    assert [e["type"] for e in ev] == ["box.started", "box.exited"]
    assert ev[1]["code"] == 0 and ev[1]["reason"] == "shutdown", ev[1]
    assert ev[0]["capabilities"]["live_checkpoint"] in (True, False)


def test_idle_and_a_command_exclude_each_other(tmp_path):
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--idle", "--", "true"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 125 and "--idle takes no command" in r.stderr


def test_restore_index_is_for_a_box_started_from_an_archive(tmp_path):
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--restore-index", "1", "--", "true"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 125 and "--restore-index needs --restore" in r.stderr
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--restore", str(tmp_path / "a.tar.zst"),
                        "--restore-index", "x"], capture_output=True, text=True, timeout=20)
    assert r.returncode == 125 and "--restore-index x: expected a number 0..1023" in r.stderr
    # Control: without --restore-index the same command runs.
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s2"), "--", "true"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr


# Sends N requests from a thread and reads no reply until /workspace/go exists; then reads them
# all and reports whether each came once, in order.
FLOOD = r'''
import json, os, threading, time
req, rep = (int(x) for x in os.environ["SANDBOXER_CHANNEL_FD"].split(","))
N = 4000
def send():
    for i in range(1, N + 1):
        os.write(req, b'{"id":%d,"op":"whoami"}\n' % i)
threading.Thread(target=send, daemon=True).start()
while not os.path.exists("/workspace/go"):
    time.sleep(0.05)
buf, ids = b"", []
while len(ids) < N:
    got = os.read(rep, 65536)
    if not got:
        break
    *lines, buf = (buf + got).split(b"\n")
    ids += [json.loads(line)["id"] for line in lines]
print(json.dumps({"replies": len(ids), "in_order": ids == list(range(1, N + 1))}), flush=True)
'''


def test_an_agent_that_reads_no_replies_holds_up_only_itself(tmp_path):
    # 4000 replies (~600 KB) are far more than the reply pipe holds. The supervisor once wrote
    # them with a blocking write(2) on its loop: it hung there for good, answering no client and
    # no SIGTERM. Now the replies wait in memory up to a bound, the agent's requests in its own
    # pipe after that, and everything else goes on.
    with WsBox(tmp_path, [sys.executable, "-c", FLOOD]) as b:
        async def go():
            async with ws_connect(b) as ws:
                s = Session(ws)
                await asyncio.sleep(1.5)  # the agent's requests fill both pipes meanwhile
                for _ in range(3):
                    r = await s.request("stats", timeout=5)
                    assert r["ok"], r
                    await asyncio.sleep(0.2)
                r = await s.request("exec", proc="go", argv=["/bin/touch", "/workspace/go"], timeout=10)
                assert r["ok"], r
        run(go())
        assert b.proc.wait(60) == 0, b.stderr()
    out = next(e["message"] for e in read_journal(b.state) if e["type"] == "proc.message")
    assert out == {"replies": 4000, "in_order": True}


def test_an_exec_into_a_tree_stopped_for_a_checkpoint_waits_for_it_and_blocks_nothing(tmp_path):
    # While a checkpoint holds the tree stopped, ns-init reads no request. An exec whose request
    # is larger than its pipe (200 KB of argv) once blocked the supervisor in write(2):
    # the hold's timer never fired, and nothing continued the tree.
    with WsBox(tmp_path, ["/bin/sleep", "600"]) as b:
        async def go():
            async with ws_connect(b) as ws:
                s = Session(ws)
                r = await s.request("checkpoint", hold_ms=3000, timeout=60)
                assert r["ok"], r
                await ws.send(json.dumps({"id": 100, "op": "exec", "proc": "big",
                                          "argv": ["/bin/sh", "-c", "exit 7", "x" * 100000, "y" * 100000]}))
                r = await s.request("stats", timeout=5)  # answered while the exec waits
                assert r["ok"], r
                r = await s.reply(100, timeout=30)  # started once the hold ends
                assert r["ok"], r
                await s.request("subscribe", since=0)
                await s.wait_event(lambda e: e["type"] == "checkpoint.released", timeout=10)
                e = await s.wait_event(lambda e: e["type"] == "proc.exited" and e["proc"] == "big", timeout=10)
                assert e["code"] == 7, e
        run(go())
