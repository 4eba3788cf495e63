"""sandboxer.agent, the agent side of the agent channel: JSON lines over the fds named by
SANDBOXER_CHANNEL_FD. The peer here is a thread playing the supervisor's side over real pipes."""
import json
import os
import threading

import pytest

from sandboxer import agent


class Peer:
    """The supervisor end: answers each request line with `answer(req)` (a list of lines)."""

    def __init__(self, answer):
        self.req_r, self.req_w = os.pipe()
        self.rep_r, self.rep_w = os.pipe()
        self.seen = []
        self.answer = answer
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        with os.fdopen(self.req_r, "rb") as f:
            for line in f:
                req = json.loads(line)
                self.seen.append(req)
                for out in self.answer(req):
                    os.write(self.rep_w, (json.dumps(out) + "\n").encode())

    @property
    def spec(self):
        return f"{self.req_w},{self.rep_r}"

    def close(self):
        os.close(self.req_w)
        self.t.join(5)
        os.close(self.rep_w)
        os.close(self.rep_r)


def test_whoami_round_trip():
    p = Peer(lambda r: [{"id": r["id"], "ok": True, "box": "b1", "branch": "main", "mode": "original"}])
    try:
        ch = agent.Channel(p.spec)
        assert ch.whoami() == {"box": "b1", "branch": "main", "mode": "original"}
        assert p.seen == [{"id": 1, "op": "whoami"}]
    finally:
        p.close()


def test_checkpoint_and_event_requests_are_shaped_per_design():
    p = Peer(lambda r: [{"id": r["id"], "ok": True}])
    try:
        ch = agent.Channel(p.spec)
        ch.checkpoint("step-3")
        ch.event("agent.note", text="hi")
        ck, ev = p.seen
        assert (ck["id"], ck["op"], ck["name"]) == (1, "checkpoint", "step-3")
        assert ev == {"id": 2, "op": "event", "event": {"type": "agent.note", "text": "hi"}}
    finally:
        p.close()


def test_identity_line_before_a_reply_is_kept():
    ident = {"box": "b2", "branch": "fork-1", "parent": "main", "snapshot": "s1", "index": 1, "mode": "live"}
    p = Peer(lambda r: [ident, {"id": r["id"], "ok": True, "name": "x"}])
    try:
        ch = agent.Channel(p.spec)
        assert ch.checkpoint("x")["name"] == "x"
        assert ch.identity == ident
    finally:
        p.close()


def test_error_reply_raises_with_code():
    p = Peer(lambda r: [{"id": r["id"], "ok": False, "error": {"code": "refused", "message": "landlock"}}])
    try:
        with pytest.raises(agent.ChannelError, match="refused: landlock") as e:
            agent.Channel(p.spec).checkpoint("x")
        assert e.value.code == "refused"
    finally:
        p.close()


def test_missing_or_bad_variable_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SANDBOXER_CHANNEL_FD", raising=False)
    with pytest.raises(agent.ChannelError, match="SANDBOXER_CHANNEL_FD is not set"):
        agent.Channel()
    with pytest.raises(agent.ChannelError, match="not an fd"):
        agent.Channel("three")


def test_supervisor_closing_the_channel_is_reported():
    p = Peer(lambda r: [])
    ch = agent.Channel(p.spec)
    os.close(p.rep_w)
    p.rep_w = os.open("/dev/null", os.O_WRONLY)
    with pytest.raises(agent.ChannelError, match="closed"):
        ch.whoami()
    p.close()


def test_on_restore_hooks_run_once_per_identity_line_after_reseeding_random(monkeypatch):
    import random
    monkeypatch.setattr(agent, "_restore_hooks", [])
    ran = []

    @agent.on_restore
    def hook(identity):
        ran.append((identity["branch"], random.random()))
        # A hook may use the channel: the request that brought the identity line has let go of it.
        ch.event("agent.reopened")

    def answer(r):
        if r["op"] == "fork":
            return [{"box": "b1", "branch": "f1", "index": 0, "mode": "live"},
                    {"id": r["id"], "ok": True, "copy": True, "branch": "f1", "index": 0}]
        return [{"id": r["id"], "ok": True}]

    p = Peer(answer)
    try:
        ch = agent.Channel(p.spec)
        random.seed(7)
        parent_draw = random.Random(7).random()  # what `random` would give without the reseed
        assert ch.whoami() is not None and ran == []  # no identity line: no hook
        r = ch.fork(1)
        assert r["copy"] is True and ch.identity["branch"] == "f1"
        assert len(ran) == 1 and ran[0][0] == "f1"
        assert ran[0][1] != parent_draw
        assert [q["op"] for q in p.seen] == ["whoami", "fork", "event"]
    finally:
        p.close()
