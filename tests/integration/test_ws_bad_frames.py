"""A corpus of bad frames: each gets an error naming the problem; the supervisor, the agent and the
connection keep going. Also the shared protocol vectors (tests/protocol/) against the real server."""
import asyncio
import json
import pathlib
import struct

import pytest

from sbxtest import Session, WsBox, run, sanitized, wait_for_path, ws_connect

VECTORS = pathlib.Path(__file__).resolve().parent.parent / "protocol"


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    with WsBox(tmp_path_factory.mktemp("bad"), ["sleep", "300"], extra=["--set", "resources.grace=1s"]) as b:
        yield b


async def still_serving(s, box):
    r = await s.request("ping")
    assert r["ok"] is True
    for _ in range(100):
        st = await s.request("stats")
        if "main" in st["procs"]:
            break
        await asyncio.sleep(0.05)
    assert "main" in st["procs"]  # the agent still runs
    assert box.alive()


# Each bad frame, the error code and id of its reply, and what the message must name.
CORPUS = [
    ("truncated JSON", '{"id": 1, "op": "sub', "bad_json", None, "not valid JSON"),
    ("empty frame", "", "bad_json", None, "not valid JSON"),
    ("a number", "42", "bad_request", None, "not a number"),
    ("a string", '"subscribe"', "bad_request", None, "not a string"),
    ("wrong type for op", '{"id": 2, "op": ["exec"]}', "bad_request", 2, "field op"),
    ("wrong type for since", '{"id": 3, "op": "subscribe", "since": {"a": 1}}', "bad_request", 3, "field since"),
    ("huge number", '{"id": 4, "op": "subscribe", "since": 1e999999}', "bad_request", 4, "field since"),
    ("huge integer", '{"id": 5, "op": "subscribe", "since": 123456789012345678901234567890}', "bad_request", 5,
     "field since"),
    ("huge id", '{"id": 123456789012345678901234567890, "op": "ping"}', "bad_request", None, "field id"),
    ("unknown op", '{"id": 6, "op": "format_disk"}', "unknown_op", 6, '"format_disk"'),
    ("deep nesting", "[" * 10000 + "]" * 10000, "bad_json", None, "too deep"),
    # A lone UTF-16 surrogate is not JSON the parser accepts: the frame is refused whole.
    ("invalid UTF-8 escape", '{"id": 7, "op": "ping", "x": "\\ud800"}', "bad_json", None, "not valid JSON"),
    ("NUL in argv", '{"id": 8, "op": "exec", "proc": "z", "argv": ["a\\u0000b"]}', "bad_request", 8,
     "field argv: contains a NUL byte"),
]


@pytest.mark.parametrize("name,frame,code,rid,names", CORPUS, ids=[c[0] for c in CORPUS])
def test_a_bad_text_frame_gets_an_error_and_the_box_keeps_serving(box, name, frame, code, rid, names):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await ws.send(frame)
            r = json.loads(await ws.recv())
            assert r == {"id": rid, "ok": False, "error": {"code": code, "message": r["error"]["message"]}}, r
            assert names in r["error"]["message"], r
            await still_serving(s, box)
    run(go(), 30)


def test_a_16_mib_text_frame_is_refused_and_the_connection_goes_on(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await ws.send('{"id": 1, "op": "ping", "pad": "' + "x" * (16 << 20) + '"}')
            r = json.loads(await ws.recv())
            # Its id, which it begins with, is answered (a client waiting for id 1 once waited
            # forever: the reply had none); one that does not begin with its id gets none.
            assert r["id"] == 1 and r["ok"] is False and r["error"]["code"] == "frame_too_large", r
            assert "exceeds" in r["error"]["message"]
            await ws.send('{"op": "ping", "pad": "' + "x" * (2 << 20) + '", "id": 2}')
            r = json.loads(await ws.recv())
            assert r["id"] is None and r["error"]["code"] == "frame_too_large", r
            await still_serving(s, box)
    run(go(), 60)


def test_a_16_mib_binary_frame_is_refused(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await ws.send(struct.pack("<IQB", 1, 0, 1) + b"\0" * (16 << 20))
            r = json.loads(await ws.recv())
            assert r["error"]["code"] == "frame_too_large"
            await still_serving(s, box)
    run(go(), 60)


def test_binary_where_text_is_due_gets_an_error(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await ws.send(struct.pack("<IQB", 99, 0, 1) + b"hello")
            r = json.loads(await ws.recv())
            assert r["id"] == 99 and r["error"]["code"] == "unexpected_binary"
            await ws.send(b"\x01\x02")
            r = json.loads(await ws.recv())
            assert r["error"]["code"] == "bad_binary"
            await still_serving(s, box)
    run(go(), 30)


def test_a_binary_frame_before_auth_closes_with_4401(box):
    from websockets.exceptions import ConnectionClosed

    async def go():
        async with ws_connect(box, header=False) as ws:
            await ws.send(b"\x00" * 20)
            with pytest.raises(ConnectionClosed) as e:
                await ws.recv()
            assert e.value.rcvd.code == 4401
    run(go(), 30)


def vectors(valid):
    reqs = json.loads((VECTORS / "requests.json").read_text())
    return [r for r in reqs if r["valid"] == valid and r.get("safe", True)]


@pytest.mark.parametrize("vec", vectors(False), ids=[v["name"] for v in vectors(False)])
def test_protocol_vector_invalid_request(box, vec):
    async def go():
        async with ws_connect(box) as ws:
            await ws.send(vec["text"])
            r = json.loads(await ws.recv())
            assert r["ok"] is False and r["error"]["code"] == vec["code"], r
            assert r["id"] == vec["id"]
    run(go(), 30)


class Optional:
    """A key of a reply that may be absent; when present, its value matches `want`."""

    def __init__(self, want):
        self.want = want


def matches(got, want):
    """`want` a type: any value of it; a set: one of its members; a dict: the same keys (but for
    Optional ones), each matching; a list: element by element; else equal, and of the same type."""
    if isinstance(want, Optional):
        want = want.want
    if isinstance(want, type):
        return isinstance(got, want) and not (want is int and isinstance(got, bool))
    if isinstance(want, set):
        return got in want
    if isinstance(want, dict):
        required = {k for k, v in want.items() if not isinstance(v, Optional)}
        return (isinstance(got, dict) and required <= got.keys() <= want.keys()
                and all(matches(got[k], want[k]) for k in got))
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(matches, got, want))
    return type(got) is type(want) and got == want  # true is not 1


# What a fresh box (agent `sleep 300`) replies to each valid vector once the vector's `prepare`
# requests have run: every key of the reply, with its exact value where the box's state decides it
# and its type where it does not (pids, seqs, times).
A_TXT = [{"op": "fs.write", "path": "/workspace/a.txt", "data": "hello"}]
RUNNING_P1 = [{"op": "exec", "proc": "p1", "argv": ["cat"], "stdin": True}]
SHELL = [{"op": "exec", "proc": "shell", "argv": ["sh"], "tty": True}]
STARTED = {"branch": "main", "state": "running", "pid": int, "ns_pid": int, "started_seq": int}
VALID = {
    "auth": ([], {"id": None, "ok": True}),
    "subscribe from the start": ([], {"id": 1, "ok": True, "last_seq": int}),
    "subscribe to a branch": ([], {"id": 2, "ok": True, "last_seq": int}),
    # `echo hi` may be over by the time of the reply: then it says so, and its pid may be gone.
    "exec with pipes": ([], {"id": 3, "ok": True, "proc": "p1", **STARTED, "state": {"running", "exited"},
                             "pid": Optional(int), "code": Optional({0}), "tty": False}),
    "exec with a pty": ([], {"id": 4, "ok": True, "proc": "shell", **STARTED, "tty": True}),
    # `ls` of an empty directory, in it: its name, the command's word and the directory are bytes.
    "exec of names that are not UTF-8": ([{"op": "fs.mkdir", "path_b64": "L3dvcmtzcGFjZS9jYWbp"}],
                                         {"id": 60, "ok": True, "proc": "p2", **STARTED, "state": {"running", "exited"},
                                          "pid": Optional(int), "code": Optional({0}), "tty": False}),
    "stdin text": (RUNNING_P1, {"id": 5, "ok": True}),
    "stdin bytes and eof": (RUNNING_P1, {"id": 6, "ok": True}),
    "signal by name": (RUNNING_P1, {"id": 7, "ok": True}),
    "signal by number": (RUNNING_P1, {"id": 8, "ok": True}),
    "resize": (SHELL, {"id": 9, "ok": True}),
    "fs.read": (A_TXT, {"id": 10, "ok": True, "size": 5, "length": 5}),
    "fs.write with binary frames": ([], {"id": 11, "ok": True, "size": 5, "path": "/workspace/a.txt"}),
    "fs.write inline": ([], {"id": 12, "ok": True, "size": 5, "path": "b.txt"}),
    "fs.write atomic": (A_TXT, {"id": 70, "ok": True, "size": 5, "path": "/workspace/c.json"}),
    "fs.list": (A_TXT, {"id": 13, "ok": True, "entries": [{"name": "a.txt", "type": "file", "size": 5, "mode": int}],
                        "more": False}),
    "fs.list whole": (A_TXT, {"id": 69, "ok": True, "entries": [{"name": "a.txt", "type": "file", "size": 5, "mode": int}]}),
    "fs.list, a page": ([{"op": "fs.write", "path": f"/workspace/{n}", "data": "x"} for n in ("a.txt", "b.txt", "d", "e")],
                        {"id": 66, "ok": True, "entries": [{"name": "b.txt", "type": "file", "size": 1, "mode": int},
                                                           {"name": "d", "type": "file", "size": 1, "mode": int}],
                         "more": True}),
    "fs.stat": (A_TXT, {"id": 14, "ok": True, "path": "/workspace/a.txt", "type": "file", "size": 5,
                        "mode": 0o644, "mtime": float}),
    "fs.stat of a name that is not UTF-8": ([{"op": "fs.write", "path_b64": "L3dvcmtzcGFjZS9jYWbp", "data": "hello"}],
                                            {"id": 57, "ok": True, "path": "/workspace/caf\ufffd",
                                             "path_b64": "L3dvcmtzcGFjZS9jYWbp", "type": "file", "size": 5,
                                             "mode": 0o644, "mtime": float}),
    "fs.stat not followed": ([{"op": "fs.symlink", "path": "/workspace/link", "target": "a.txt"}],
                             {"id": 53, "ok": True, "path": "/workspace/link", "type": "symlink", "size": 5,
                              "mode": 0o777, "mtime": float, "target": "a.txt"}),
    "fs.remove": (A_TXT, {"id": 15, "ok": True}),
    "fs.rename": (A_TXT, {"id": 46, "ok": True}),
    "fs.mkdir with a mode": ([], {"id": 47, "ok": True}),
    "fs.symlink": ([], {"id": 48, "ok": True}),
    "fs.symlink with bytes that are not UTF-8": ([], {"id": 54, "ok": True}),
    "fs.chmod": (A_TXT, {"id": 49, "ok": True}),
    "stats": ([], {"id": 16, "ok": True, "box": dict, "branches": dict, "procs": dict, "last_seq": int}),
    "string id": ([], {"id": "req-17", "ok": True, "pong": True}),
}


def test_every_valid_vector_has_an_expected_reply():
    assert sorted(VALID) == sorted(v["name"] for v in vectors(True))


@pytest.mark.parametrize("vec", vectors(True), ids=[v["name"] for v in vectors(True)])
def test_protocol_vector_valid_request_gets_its_reply(tmp_path, vec):
    prepare, want = VALID[vec["name"]]
    with WsBox(tmp_path, ["sleep", "300"], extra=["--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                for i, req in enumerate(prepare):
                    r = await s.request(id=1000 + i, **req)
                    assert r["ok"] is True, (req, r)
                text = vec["text"].replace('"token":"T"', f'"token":"{box.token}"')
                await ws.send(text)
                if '"fs.write"' in text and '"data"' not in text:
                    await ws.send(struct.pack("<IQB", json.loads(text)["id"], 0, 1) + b"hello")
                r = await s.reply(json.loads(text).get("id"))
                if vec["name"] == "fs.read":  # then the content, in one frame flagged last
                    while not s.binary:
                        await s.recv_one()
                    return r, s.binary
                return r, []
        r, frames = run(go(), 30)
        assert matches(r, want), json.dumps(r)
        if vec["name"] == "fs.read":
            assert frames == [struct.pack("<IQB", 10, 0, 1) + b"hello"]


def test_snapshot_import_frames_that_disagree_with_size_are_refused(tmp_path):
    """An upload past its announced size, or one ending short of it, gets a clear error; the
    store keeps no temporary file and the connection keeps serving."""
    def header(rid, offset, last):
        return struct.pack("<IQB", rid, offset, 1 if last else 0)

    with WsBox(tmp_path, ["sleep", "60"], extra=["--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                no_size = await s.request("snapshot.import")
                await ws.send(json.dumps({"id": 7, "op": "snapshot.import", "size": 10}))
                await ws.send(header(7, 0, True) + b"x" * 11)
                past = await s.reply(7)
                await ws.send(json.dumps({"id": 8, "op": "snapshot.import", "size": 10}))
                await ws.send(header(8, 0, True) + b"x" * 4)
                short = await s.reply(8)
                await ws.send(json.dumps({"id": 9, "op": "snapshot.import", "size": 3}))
                await ws.send(header(9, 0, True) + b"abc")
                junk = await s.reply(9)
                bad_export = await s.request("snapshot.export", snapshot="../../etc/passwd")
                # 2^63-1: twice it plus the journal's room wrapped past 2^64, and the import was
                # accepted with nothing but its own size to stop it filling the state dir's disk.
                huge = await s.request("snapshot.import", size=(1 << 63) - 1)
                ping = await s.request("ping")
                return no_size, past, short, junk, bad_export, huge, ping
        no_size, past, short, junk, bad_export, huge, ping = run(go())
        assert not huge["ok"] and huge["error"]["code"] == "no_space", huge
        assert not no_size["ok"] and "size" in no_size["error"]["message"]
        assert not past["ok"] and "past the 10 bytes" in past["error"]["message"]
        assert not short["ok"] and "4 of the 10 bytes" in short["error"]["message"]
        assert not junk["ok"] and junk["error"]["code"] == "bad_snapshot"
        assert not bad_export["ok"] and "not a snapshot id" in bad_export["error"]["message"]
        assert ping["ok"]
        snaps = box.state / "snapshots"
        assert not snaps.exists() or not any(p.name.startswith(".import-") for p in snaps.iterdir())
        assert box.alive()


def test_transfers_a_connection_opens_and_never_finishes_are_bounded(tmp_path):
    # Each open fs.write holds two fds until its last frame: a client that opened 10,000 and sent
    # no frame took the supervisor's whole RLIMIT_NOFILE (criu, exec and every file op failed).
    with WsBox(tmp_path, ["sleep", "60"], extra=["--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as ws, ws_connect(box) as other:
                s, o = Session(ws), Session(other)
                for i in range(1, 301):
                    await ws.send(json.dumps({"id": i, "op": "fs.write", "path": f"/workspace/f{i}", "size": 10}))
                refused = [r for r in [await s.reply(i) for i in range(257, 301)] if not r["ok"]]
                read = await s.request("fs.read", id=400, path="/workspace/f1")
                theirs = await o.request("fs.write", id=1, path="/workspace/g", data="other")
                return refused, read, theirs
        refused, read, theirs = run(go())
    assert len(refused) == 44 and all(r["error"]["code"] == "limit" for r in refused), refused[:2]
    assert "256 transfers open" in refused[0]["error"]["message"], refused[0]
    assert not read["ok"] and read["error"]["code"] == "limit"
    assert theirs["ok"], theirs  # another connection is not held up by it


def test_replies_a_client_does_not_read_are_bounded(tmp_path):
    # 600 fs.list of a directory of 4000 names (~170 KB a reply, ~100 MB in all), and nothing read
    # for 3 s: the replies once all waited in the supervisor's memory (30 MB/s, until the stall
    # close). Now its requests are not read past 16 MiB of replies owed; all are answered once
    # it reads.
    script = ("import os\nos.makedirs('/workspace/d')\n"
              "for i in range(4000): open(f'/workspace/d/file-with-a-longish-name-{i:05}', 'w').close()\n"
              "open('/workspace/ready', 'w').close()\nimport time; time.sleep(120)\n")
    with WsBox(tmp_path, ["python3", "-c", script], extra=["--set", "resources.grace=1s"]) as box:
        def rss_kib():
            with open(f"/proc/{box.proc.pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

        async def go():
            async with ws_connect(box, max_queue=None) as ws:
                s = Session(ws)
                await wait_for_path(s, "/workspace/ready", timeout=30)
                before = rss_kib()
                ws.transport.pause_reading()
                for i in range(1000, 1600):
                    await ws.send(json.dumps({"id": i, "op": "fs.list", "path": "/workspace/d"}))
                await asyncio.sleep(3)
                grown = rss_kib() - before
                ws.transport.resume_reading()
                got = [await s.reply(i, timeout=60) for i in range(1000, 1600)]
                return grown, got
        grown, got = run(go(), timeout=180)
    assert all(r["ok"] and len(r["entries"]) == 4000 for r in got)
    if not sanitized():  # ASan holds what was freed in its quarantine (380 MiB here)
        assert grown < 48 << 10, f"the supervisor grew by {grown} KiB"  # 17 MiB here; 79 for 400 before
