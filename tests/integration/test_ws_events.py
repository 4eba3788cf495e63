"""The event path under load: a Close (or an unsubscribe) is answered at once however much is
queued, a client that lags behind the live stream is served from the journal until it has caught
up (never closed while it reads), and only a client that reads nothing is closed with 4008."""
import asyncio
import base64
import json
import os
import socket
import sys
import time

import pytest

from websockets.exceptions import ConnectionClosed

from sbxtest import PROBE, Session, WsBox, run, ws_connect

# An agent that writes without end: the stream is live and busy for as long as a test runs.
BUSY = ["sh", "-c", f"while :; do {PROBE} spew 4000000 || exit 1; done"]


def spew_bytes(n):
    """What `sbx-testprobe spew n` writes: 64-byte numbered lines, cut at n bytes."""
    tail = b" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
    out = bytearray()
    i = 0
    while len(out) < n:
        out += b"%010d" % i + tail
        i += 1
    return bytes(out[:n])


def stdout_bytes(events):
    out = bytearray()
    for e in events:
        if e["type"] == "proc.output" and e.get("stream") == "stdout":
            out += base64.b64decode(e["data_b64"]) if "data_b64" in e else e["data"].encode()
    return bytes(out)


def rcvd_code(ws):
    """The code of the Close frame the server sent, None when none came (a timed-out close)."""
    rcvd = ws.protocol.close_rcvd
    return rcvd.code if rcvd else None


async def close_reading(ws):
    """Sends a Close and reads on until the server's Close: a client library stops reading its
    socket while frames wait unread (websockets pauses at max_queue), and the server's Close is
    behind what the kernel already holds for the client."""
    async def drain():
        try:
            while True:
                await ws.recv()
        except ConnectionClosed:
            pass
    reader = asyncio.ensure_future(drain())
    await ws.close()
    await reader
    return rcvd_code(ws)


async def busy_subscriber(box, **kw):
    ws = await ws_connect(box, close_timeout=1, **kw).__aenter__()
    s = Session(ws)
    await s.request("subscribe", since=0)
    # Live and busy: output events are arriving (each up to 128 KiB of output: 50 are several MB,
    # and the server has more queued behind them).
    await s.wait_event(lambda e: e["type"] == "proc.output", 30)
    for _ in range(50):
        await s.recv_one(30)
    return ws, s


def test_a_close_from_a_client_of_a_busy_live_stream_is_answered_with_1000(tmp_path):
    with WsBox(tmp_path, BUSY) as box:
        async def go():
            codes = []
            for _ in range(5):
                ws, _s = await busy_subscriber(box)
                # The server's Close must come before the client's 1 s close timeout: then the
                # close completes with the server's 1000, not a 1006 of a timed-out close.
                codes.append(await close_reading(ws))
            return codes
        codes = run(go(), 90)
        assert codes == [1000] * 5, codes
        assert box.alive()


def test_a_close_from_a_client_that_has_not_read_its_backlog_is_answered(tmp_path):
    with WsBox(tmp_path, BUSY) as box:
        async def go():
            ws, s = await busy_subscriber(box)
            # Let the server fill the socket and its queue for this client, then leave.
            await asyncio.sleep(1)
            return await close_reading(ws)
        assert run(go(), 60) == 1000
        assert box.alive()


def test_unsubscribe_stops_the_stream_at_once(tmp_path):
    with WsBox(tmp_path, BUSY) as box:
        async def go():
            ws, s = await busy_subscriber(box)
            await asyncio.sleep(0.5)
            r = await s.request("unsubscribe", timeout=30)
            assert r["ok"], r
            # After the reply no event comes: a ping's reply is the next frame read.
            n = len(s.events)
            p = await s.request("ping", timeout=30)
            assert p["ok"], p
            assert len(s.events) == n
            return await close_reading(ws)
        assert run(go(), 60) == 1000


def test_the_python_sdk_leaves_a_busy_stream_with_a_clean_close(tmp_path):
    from sandboxer import Box
    with WsBox(tmp_path, BUSY) as box:
        async def go():
            async with await Box.connect(box.url, token=box.token) as b:
                async with b.events() as stream:
                    n = 0
                    async for ev in stream:
                        n += ev["type"] == "proc.output"
                        if n >= 200:
                            ws = stream._ws  # the stream's own connection, to see its close
                            break
            return ws
        ws = run(go(), 60)
        # The SDK's close (connect timeout 2 s) completed with the server's Close, not by timing out.
        assert rcvd_code(ws) == 1000


def gated_spew(n):
    """An agent that waits for /workspace/go, writes `n` bytes of spew, then an end marker."""
    return ["sh", "-c", "while [ ! -e /workspace/go ]; do sleep 0.01; done; "
            f"{PROBE} spew {n} && echo END-OF-STREAM && exec sleep 600"]


def is_end(e):
    return e["type"] == "proc.output" and "END-OF-STREAM" in e.get("data", "")


async def read_all(box, delay=0.0):
    """Subscribes, reports live, then reads every event until the end marker (sleeping `delay`
    after each frame: a slow reader). Returns the raw frames, parsed at the end."""
    async with ws_connect(box) as ws:
        s = Session(ws)
        await s.request("subscribe", since=0)
        await s.wait_event(lambda e: e["type"] == "proc.started" and e["proc"] == "main", 30)
        yield_live = True
        frames = []
        while True:
            if yield_live:
                yield_live = False
                yield None
            m = await asyncio.wait_for(ws.recv(), 60)
            frames.append(m)
            if "END-OF-STREAM" in m:
                break
            if delay:
                await asyncio.sleep(delay)
        yield s.events + [json.loads(m) for m in frames]


@pytest.mark.parametrize("recent", ["0", str(1 << 20), None], ids=["journal", "both", "memory"])
def test_lagging_clients_get_every_byte_once_in_order_and_only_a_non_reader_gets_4008(tmp_path, recent):
    # 4 MiB through a 64 KiB queue bound: every client falls behind the live stream many times
    # (each read of the agent's output is an event of up to 128 KiB) and catches up: from the
    # journal on disk, from the events held in memory for clients catching up (`recent`, 32 MiB by
    # default), or from both in turn; 48 read at once, one reads slowly, one reads nothing until
    # long after the end.
    n = 4 << 20
    env = {**os.environ, "SANDBOXER_WS_QUEUE_BYTES": str(64 << 10), "SANDBOXER_WS_STALL_SECONDS": "2"}
    if recent is not None:
        env["SANDBOXER_WS_RECENT_BYTES"] = recent
    with WsBox(tmp_path, gated_spew(n), env=env) as box:
        async def go():
            readers = [read_all(box) for _ in range(48)] + [read_all(box, delay=0.02)]
            for r in readers:
                assert await r.__anext__() is None  # subscribed and live
            # The non-reader's socket takes little: the frames it is owed wait in the server.
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", box.port))
            async with ws_connect(box, sock=sock, max_queue=1) as stuck:
                st = Session(stuck)
                await st.request("subscribe", since=0)
                (box.workspace / "go").touch()
                results = await asyncio.gather(*(r.__anext__() for r in readers))
                # The non-reader has owed frames and took nothing for the stall time: 4008.
                await asyncio.sleep(3)
                code = None
                try:
                    while True:
                        await asyncio.wait_for(stuck.recv(), 30)
                except ConnectionClosed as e:
                    code = e.rcvd.code if e.rcvd else None
                    reason = e.rcvd.reason if e.rcvd else ""
            return results, code, reason
        results, code, reason = run(go(), 150)
        want = spew_bytes(n) + b"END-OF-STREAM\n"
        for events in results:
            seqs = [e["seq"] for e in events]
            assert seqs == list(range(1, seqs[-1] + 1))
            assert stdout_bytes(events) == want
        assert code == 4008 and reason.startswith("resume_after="), (code, reason)
        assert box.alive()


def test_a_client_that_reads_nothing_does_not_hold_the_boxs_end(tmp_path):
    # The end of a box waits for its clients while they take their last events (however busy the
    # machine), but not for one that takes nothing: the box still ends, within the drain's bound.
    # The agent writes once the client has subscribed (else, on a busy machine, the box could
    # end before the subscribe reached it: the client then got 1001 at its send).
    agent = ["python3", "-c", "import os, sys, time\nwhile not os.path.exists('/workspace/go'): time.sleep(0.02)\n"
             "sys.stdout.write(('x' * 4095 + '\\n') * 4096); sys.stdout.flush()"]
    with WsBox(tmp_path, agent + [], extra=["--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as ws:
                await ws.send(json.dumps({"id": 1, "op": "subscribe", "since": 0}))
                (box.workspace / "go").touch()
                t0 = time.monotonic()
                await asyncio.sleep(0.2)  # reads nothing while the box ends
                while box.proc.poll() is None and time.monotonic() - t0 < 30:
                    await asyncio.sleep(0.1)
                return time.monotonic() - t0
        took = run(go(), 60)
        assert box.proc.poll() is not None and took < 15, took
