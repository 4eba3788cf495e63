"""A corpus of bad frames: each gets an error naming the problem; the supervisor, the agent and the
connection keep going. Also the shared protocol vectors (tests/protocol/) against the real server."""
import asyncio
import json
import pathlib
import struct

import pytest

from wsbox import Session, WsBox, run, ws_connect

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


CORPUS = [
    ("truncated JSON", '{"id": 1, "op": "sub', "bad_json"),
    ("empty frame", "", "bad_json"),
    ("a number", "42", "bad_request"),
    ("a string", '"subscribe"', "bad_request"),
    ("wrong type for op", '{"id": 2, "op": ["exec"]}', "bad_request"),
    ("wrong type for since", '{"id": 3, "op": "subscribe", "since": {"a": 1}}', "bad_request"),
    ("huge number", '{"id": 4, "op": "subscribe", "since": 1e999999}', "bad_request"),
    ("huge integer", '{"id": 5, "op": "subscribe", "since": 123456789012345678901234567890}', "bad_request"),
    ("huge id", '{"id": 123456789012345678901234567890, "op": "ping"}', "bad_request"),
    ("unknown op", '{"id": 6, "op": "format_disk"}', "unknown_op"),
    ("deep nesting", "[" * 10000 + "]" * 10000, "bad_json"),
    ("invalid UTF-8 escape", '{"id": 7, "op": "ping", "x": "\\ud800"}', None),
    ("NUL in argv", '{"id": 8, "op": "exec", "proc": "z", "argv": ["a\\u0000b"]}', "bad_request"),
]


@pytest.mark.parametrize("name,frame,code", CORPUS, ids=[c[0] for c in CORPUS])
def test_a_bad_text_frame_gets_an_error_and_the_box_keeps_serving(box, name, frame, code):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await ws.send(frame)
            r = json.loads(await ws.recv())
            if code is None:
                assert "ok" in r  # answered, either way
            else:
                assert r["ok"] is False and r["error"]["code"] == code, r
                assert r["error"]["message"]
            await still_serving(s, box)
    run(go(), 30)


def test_a_16_mib_text_frame_is_refused_and_the_connection_goes_on(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await ws.send('{"id": 1, "op": "ping", "pad": "' + "x" * (16 << 20) + '"}')
            r = json.loads(await ws.recv())
            assert r["ok"] is False and r["error"]["code"] == "frame_too_large"
            assert "exceeds" in r["error"]["message"]
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


@pytest.mark.parametrize("vec", vectors(True), ids=[v["name"] for v in vectors(True)])
def test_protocol_vector_valid_request_parses(box, vec):
    async def go():
        async with ws_connect(box) as ws:
            text = vec["text"].replace('"token":"T"', f'"token":"{box.token}"')
            await ws.send(text)
            if '"fs.write"' in text and '"data"' not in text:
                await ws.send(struct.pack("<IQB", json.loads(text)["id"], 0, 1) + b"hello")
            while True:
                m = await ws.recv()
                if isinstance(m, str) and '"seq"' not in m[:8]:
                    break
            r = json.loads(m)
            # It may fail on the box's state (no such proc), never on its form.
            if not r["ok"]:
                assert r["error"]["code"] not in ("bad_json", "bad_request", "unknown_op"), r
    run(go(), 30)


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
                ping = await s.request("ping")
                return no_size, past, short, junk, bad_export, ping
        no_size, past, short, junk, bad_export, ping = run(go())
        assert not no_size["ok"] and "size" in no_size["error"]["message"]
        assert not past["ok"] and "past the 10 bytes" in past["error"]["message"]
        assert not short["ok"] and "4 of the 10 bytes" in short["error"]["message"]
        assert not junk["ok"] and junk["error"]["code"] == "bad_snapshot"
        assert not bad_export["ok"] and "not a snapshot id" in bad_export["error"]["message"]
        assert ping["ok"]
        snaps = box.state / "snapshots"
        assert not snaps.exists() or not any(p.name.startswith(".import-") for p in snaps.iterdir())
        assert box.alive()
