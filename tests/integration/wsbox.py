"""A box with the WebSocket API on a free loopback port, and small client helpers.

The box is the real sandboxer-init with --listen 127.0.0.1:0; its port comes from the
`server.listening` event. Clients are the real `websockets` package."""
import asyncio
import json
import os
import pathlib
import secrets
import signal
import subprocess
import time

from websockets.asyncio.client import connect

from sbxtest import INIT

SUBPROTOCOL = "sandboxer.v1"


class WsBox:
    def __init__(self, tmp_path, argv, *, extra=(), env=None, metrics="0"):
        self.dir = pathlib.Path(tmp_path)
        self.state = self.dir / "state"
        self.events = self.dir / "events.jsonl"
        self.token = secrets.token_hex(16)
        self.token_file = self.dir / "token"
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        cmd = [str(INIT), "--state-dir", str(self.state), "--events", str(self.events),
               "--listen", "127.0.0.1:0", "--token-file", str(self.token_file),
               "--metrics-interval", metrics, "--log-level", os.environ.get("SBX_TEST_LOG", "info"),
               *extra, "--", *argv]
        self.stderr = open(self.dir / "init.stderr", "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.stderr,
                                     env=env, start_new_session=True)
        self.port = self._wait_port()
        self.url = f"ws://127.0.0.1:{self.port}"

    def _wait_port(self, timeout=15):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.events.exists():
                for line in self.events.read_text().splitlines():
                    ev = json.loads(line)
                    if ev["type"] == "server.listening":
                        return ev["port"]
            if self.proc.poll() is not None:
                raise RuntimeError("sandboxer-init exited: " + (self.dir / "init.stderr").read_text())
            time.sleep(0.02)
        raise TimeoutError("no server.listening event")

    @property
    def workspace(self):
        return self.state / "branches" / "main" / "workspace"

    def alive(self):
        return self.proc.poll() is None

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.stop()


def ws_connect(box, *, token=None, header=True, **kw):
    headers = {"Authorization": f"Bearer {token or box.token}"} if header else {}
    kw.setdefault("max_size", 64 << 20)
    # A client that stops reading with a backlog cannot see the close answer behind it: do not wait long.
    kw.setdefault("close_timeout", 1)
    return connect(box.url, subprotocols=[SUBPROTOCOL], additional_headers=headers, open_timeout=10, **kw)


class Session:
    """Requests with ids; events set aside as they arrive."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 1
        self.events = []
        self.binary = []

    async def recv_one(self, timeout=30):
        m = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(m, bytes):
            self.binary.append(m)
            return None
        obj = json.loads(m)
        if "seq" in obj and "id" not in obj:
            self.events.append(obj)
            return None
        return obj

    async def request(self, op, timeout=30, **fields):
        rid = fields.pop("id", None)
        if rid is None:
            rid = self.next_id
            self.next_id += 1
        await self.ws.send(json.dumps({"id": rid, "op": op, **fields}))
        return await self.reply(rid, timeout)

    async def reply(self, rid, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to {rid}")
            r = await self.recv_one(left)
            if r is not None and r.get("id") == rid:
                return r

    async def wait_event(self, pred, timeout=30):
        deadline = time.monotonic() + timeout
        for e in self.events:
            if pred(e):
                return e
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("event not seen")
            n = len(self.events)
            await self.recv_one(left)
            for e in self.events[n:]:
                if pred(e):
                    return e


def output_of(events, proc):
    import base64
    buf = bytearray()
    for e in events:
        if e["type"] == "proc.output" and e.get("proc") == proc:
            buf += e["data"].encode() if "data" in e else base64.b64decode(e["data_b64"])
    return bytes(buf)


def run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def follow(box, until, since=0, timeout=120):
    """Subscribes from `since` and reads until `until(event)`, resuming after a 4008 (too slow)
    from the last seq seen, as the SDKs do. Returns every event seen, each once."""
    from websockets.exceptions import ConnectionClosed
    events = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with ws_connect(box) as ws:
                s = Session(ws)
                await s.request("subscribe", since=events[-1]["seq"] if events else since)
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("follow: condition not met")
                    n = len(s.events)
                    await s.recv_one(left)
                    for e in s.events[n:]:
                        events.append(e)
                        if until(e):
                            return events
        except ConnectionClosed as e:
            if e.rcvd is None or e.rcvd.code != 4008:
                raise
