"""sdk/python against the shared protocol vectors (tests/protocol/): binary headers, close
codes, how frames are told apart, error replies; the agent channel (channel.json) as
sandboxer.agent speaks it; and, against the real supervisor, that each request the SDK sends is
the vector's request and each refused one raises the vector's code."""
import asyncio
import json
import os
import pathlib
import re
import threading

import pytest
from websockets.asyncio.client import ClientConnection

from sandboxer import Box, SandboxerError, agent, frames
from sbxtest import run
from sandboxer.connection import CLOSE_AUTH, CLOSE_SLOW, classify
from sandboxer.events import parse_resume_after
from sandboxer.process import output_bytes
from sbxtest import run

VECTORS = pathlib.Path(__file__).resolve().parent.parent / "protocol"


def load(name):
    return json.loads((VECTORS / name).read_text())


# -- no server needed -------------------------------------------------------------------------

@pytest.mark.parametrize("v", load("binary.json"), ids=lambda v: v["name"])
def test_binary_header_vector_decodes_and_encodes(v):
    frame = bytes.fromhex(v["hex"] + v["data_hex"])
    c = frames.decode_chunk(frame)
    assert (c.request_id, c.offset, c.flags, c.last) == (v["id"], v["offset"], v["flags"], v["last"])
    assert c.data == bytes.fromhex(v["data_hex"])
    assert frames.encode_chunk(v["id"], v["offset"], c.data, last=v["last"], flags=v["flags"]) == frame


def test_close_code_vectors_match_the_client():
    codes = {v["code"]: v for v in load("close.json")}
    assert CLOSE_AUTH in codes and CLOSE_SLOW in codes
    assert parse_resume_after(codes[CLOSE_SLOW]["reason_example"]) == 1234
    assert parse_resume_after("resume_after=x") is None


@pytest.mark.parametrize("v", load("events.json"), ids=lambda v: v["name"])
def test_event_vectors_are_events(v):
    assert classify(v["frame"]) == "event"
    if v["frame"]["type"] == "proc.output" and "bytes_hex" in v:
        assert output_bytes(v["frame"]) == bytes.fromhex(v["bytes_hex"])


@pytest.mark.parametrize("v", load("replies.json"), ids=lambda v: v["name"])
def test_reply_vectors_are_replies_and_errors_are_typed(v):
    frame = v["frame"]
    assert classify(frame) == "reply"
    if not frame["ok"]:
        err = SandboxerError.from_reply(frame, "op")
        assert (err.code, err.message) == (frame["error"]["code"], frame["error"]["message"])
        assert err.reply == frame


# -- the agent channel (channel.json), against a peer playing the supervisor's side -------------

class ChannelPeer:
    """Reads one request line from the agent's channel and answers with `lines`."""

    def __init__(self, lines):
        self.req_r, self.req_w = os.pipe()
        self.rep_r, self.rep_w = os.pipe()
        self.lines = lines
        self.seen = None
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        with os.fdopen(self.req_r, "rb") as f:
            line = f.readline()
            self.seen = json.loads(line)
            for out in self.lines(self.seen):
                os.write(self.rep_w, (json.dumps(out) + "\n").encode())

    def channel(self):
        return agent.Channel(f"{self.req_w},{self.rep_r}")

    def close(self):
        os.close(self.req_w)
        self.t.join(5)
        os.close(self.rep_w)
        os.close(self.rep_r)


S = "s-0123456789abcdef"
# What the sandboxer.agent call for each valid channel request vector is (None: the module does not
# send that request, e.g. it picks integer ids itself).
CHANNEL_CALLS = {
    "whoami": lambda ch: ch.whoami(),
    "checkpoint": lambda ch: ch.checkpoint("before-step-3"),
    "checkpoint that ends the original": lambda ch: ch.checkpoint("last", leave_running=False),
    "event": lambda ch: ch.event("agent.note", text="hi"),
    "event with a bare type and the journal's fields":
        lambda ch: ch.event("note", seq=1, ts="x", box="forged", branch="f9", proc="p", n=2),
    "fork": lambda ch: ch.fork(4),
    "restore": lambda ch: ch.restore(S),
    "snapshot.list": lambda ch: ch.snapshots(),
    "snapshot.delete": lambda ch: ch.delete_snapshot(S),
    "a string id": None,
}


def test_every_valid_channel_vector_is_mapped_to_its_call():
    assert sorted(v["name"] for v in load("channel.json")["requests"] if v["valid"]) == sorted(CHANNEL_CALLS)


@pytest.mark.parametrize("v", [v for v in load("channel.json")["requests"] if CHANNEL_CALLS.get(v["name"])],
                         ids=lambda v: v["name"])
def test_channel_request_vector_is_what_the_agent_module_sends(v):
    call = CHANNEL_CALLS[v["name"]]
    p = ChannelPeer(lambda r: [{"id": r["id"], "ok": True, "snapshots": []}])
    try:
        call(p.channel())
        want = json.loads(v["text"])
        assert {k: x for k, x in p.seen.items() if k != "id"} == {k: x for k, x in want.items() if k != "id"}
        assert isinstance(p.seen["id"], int)
    finally:
        p.close()


@pytest.mark.parametrize("v", load("channel.json")["replies"], ids=lambda v: v["name"])
def test_channel_reply_vector_is_returned_or_raised(v):
    frame = v["frame"]

    def answer(r):
        # The vector's reply to this request: its id is the one the module sent (or null).
        return [dict(frame, id=r["id"] if frame["id"] is not None else None)]

    p = ChannelPeer(answer)
    try:
        ch = p.channel()
        if frame["ok"]:
            assert ch.request("whoami") == dict(frame, id=1)
        else:
            with pytest.raises(agent.ChannelError) as e:
                ch.request("whoami")
            assert (e.value.code, e.value.message) == (frame["error"]["code"], frame["error"]["message"])
    finally:
        p.close()


@pytest.mark.parametrize("v", load("channel.json")["identity"], ids=lambda v: v["name"])
def test_channel_identity_vector_is_kept_and_skipped(v):
    p = ChannelPeer(lambda r: [v["frame"], {"id": r["id"], "ok": True, "snapshots": []}])
    try:
        ch = p.channel()
        assert ch.snapshots() == []
        assert ch.identity == v["frame"]
    finally:
        p.close()


def test_channel_request_fields_cannot_be_named_id():
    ch = agent.Channel("0,1")
    with pytest.raises(ValueError, match="id"):
        ch.request("snapshot.delete", id=S)


# -- against the real supervisor --------------------------------------------------------------

# Fields whose absence means the same as this value; a vector may spell them out or not.
DEFAULTS = {"tty": False, "stdin": False, "eof": False, "recursive": False, "append": False}


def normalized(text):
    obj = json.loads(text)
    obj.pop("id", None)
    return {k: v for k, v in obj.items() if not (k in DEFAULTS and v == DEFAULTS[k])}


async def quietly(coro):
    """Runs an SDK call whose reply does not matter here (e.g. a proc the test box lacks)."""
    try:
        await asyncio.wait_for(coro, 5)
    except (SandboxerError, asyncio.TimeoutError):
        pass


async def first_event(stream):
    try:
        await asyncio.wait_for(stream.__anext__(), 2)
    except asyncio.TimeoutError:
        pass
    await stream.close()


# What the SDK call for each valid request vector is.
CALLS = {
    "subscribe from the start": lambda b: first_event(b.events(since=0)),
    "subscribe to a branch": lambda b: first_event(b.events(since=41, branch="main")),
    "exec with pipes": lambda b: b.exec(["sh", "-c", "echo hi"], proc="p1", env={"A": "1"}, cwd="/workspace",
                                        stdin=True),
    "exec with a pty": lambda b: b.exec(["sh"], proc="shell", tty=True, cols=120, rows=40),
    "exec of names that are not UTF-8": lambda b: b.exec(["ls", b"/workspace/caf\xe9"], proc="p2", env={"A": b"\xff"},
                                                         cwd="/workspace/caf\udce9"),
    "stdin text": lambda b: b.stdin("p1", "hello\n"),
    "stdin bytes and eof": lambda b: b.stdin("p1", b"\xff", eof=True),
    "signal by name": lambda b: b.signal("p1", "TERM"),
    "signal by number": lambda b: b.signal("p1", 15),
    "resize": lambda b: b.resize("shell", 100, 30),
    "fs.read": lambda b: b.fs.read("/workspace/a.txt"),
    "fs.write with binary frames": lambda b: b.fs.write("/workspace/a.txt", b"hello", inline=False),
    "fs.write inline": lambda b: b.fs.write("b.txt", "small"),
    "fs.write atomic": lambda b: b.fs.write("/workspace/c.json", b"hello", atomic=True, inline=False),
    "fs.list": lambda b: b.fs.list("/workspace"),
    "fs.list, a page": lambda b: b.fs.list_page("/workspace", limit=2, after="a.txt"),
    "fs.list whole": lambda b: b.request("fs.list", path="/workspace"),  # what an older SDK sent
    "fs.stat": lambda b: b.fs.stat("/workspace/a.txt"),
    "fs.stat not followed": lambda b: b.fs.stat("/workspace/link", follow=False),
    "fs.stat of a name that is not UTF-8": lambda b: b.fs.stat(b"/workspace/caf\xe9"),
    "fs.remove": lambda b: b.fs.remove("/workspace/a.txt"),
    "fs.rename": lambda b: b.fs.rename("/workspace/a.txt", "/workspace/b.txt"),
    "fs.mkdir with a mode": lambda b: b.fs.mkdir("/workspace/d", mode=0o750),
    "fs.symlink": lambda b: b.fs.symlink("/workspace/link", "a.txt"),
    "fs.symlink with bytes that are not UTF-8": lambda b: b.fs.symlink("/workspace/latin", b"caf\xe9"),
    "fs.chmod": lambda b: b.fs.chmod("/workspace/a.txt", 0o600),
    "stats": lambda b: b.stats(),
    "string id": lambda b: b.request("ping"),
    "shutdown": lambda b: b.shutdown("2s"),
}


def test_every_valid_request_vector_is_what_the_sdk_sends(server, monkeypatch):
    vectors = [v for v in load("requests.json") if v["valid"]]
    sent = []
    real_send = ClientConnection.send

    async def spy(self, message):
        if isinstance(message, str):
            sent.append(message)
        return await real_send(self, message)

    monkeypatch.setattr(ClientConnection, "send", spy)

    async def go():
        mismatches, missing = [], []
        # The auth frame: sent by a client that cannot set headers.
        async with await Box.connect(server.url, server.token, auth_frame=True):
            pass
        auth = [t for t in sent if json.loads(t).get("op") == "auth"][0]
        want = normalized([v for v in vectors if v["name"] == "auth"][0]["text"].replace('"T"', json.dumps(server.token)))
        if normalized(auth) != want:
            mismatches.append(("auth", auth))
        async with await Box.connect(server.url, server.token) as box:
            for v in sorted(vectors, key=lambda v: v.get("safe", True) is False):  # shutdown last
                if v["name"] == "auth":
                    continue
                call = CALLS.get(v["name"])
                if call is None:
                    missing.append(v["name"])
                    continue
                sent.clear()
                await quietly(call(box))
                want = normalized(v["text"])
                got = [normalized(t) for t in sent if json.loads(t).get("op") == want["op"]]
                if want not in got:
                    mismatches.append((v["name"], got))
        return mismatches, missing

    mismatches, missing = run(go(), 60)
    assert missing == []
    assert mismatches == []


def expressible(v):
    """An invalid vector the SDK can send through Box.request: a JSON object with a string op and
    a small integer id (the SDK picks its own ids), whose refusal is not about the id."""
    try:
        obj = json.loads(v["text"])
    except ValueError:
        return False
    return (isinstance(obj, dict) and isinstance(obj.get("op"), str) and isinstance(obj.get("id"), int)
            and obj["id"] < 1 << 31 and v.get("id") is not None and not re.search(r"\bid\b", v["name"]))


def test_every_refused_request_vector_raises_its_code(server):
    vectors = [v for v in load("requests.json") if not v["valid"] and expressible(v)]
    assert len(vectors) >= 15

    async def go():
        wrong = []
        async with await Box.connect(server.url, server.token) as box:
            for v in vectors:
                fields = json.loads(v["text"])
                fields.pop("id")
                op = fields.pop("op")
                try:
                    await box.request(op, **fields)
                    wrong.append((v["name"], "accepted"))
                except SandboxerError as e:
                    if e.code != v["code"] or not e.message:
                        wrong.append((v["name"], e.code, e.message))
            await box.stats()  # still serving
        return wrong

    assert run(go(), 60) == []
    assert server.alive()
