"""The WebSocket API before authentication (issue #13, item 11).

Anyone who can reach the port gets this far. Before, such a client could make the supervisor
buffer a 1 MiB frame, and hold as many connections as lws allows (4,096). Now a frame before
authentication is capped at 4 KiB (close 1009 with the reason), at most 64 unauthenticated
connections are open at once (the next gets HTTP 503), each has 10 s to authenticate, and the
authenticated path keeps its 1 MiB frames."""
import asyncio
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from sbxtest import Session, WsBox, run, ws_connect

pytestmark = pytest.mark.timeout(90)

MAX_UNAUTHENTICATED = 64


@pytest.fixture
def box(tmp_path):
    with WsBox(tmp_path, ["sleep", "120"]) as b:
        yield b


async def still_serving(box):
    async with ws_connect(box) as ws:
        r = await Session(ws).request("ping")
        assert r["ok"] is True and r["pong"] is True, r


def test_a_64_kib_frame_before_auth_is_refused(box):
    async def go():
        async with ws_connect(box, header=False) as ws:
            await ws.send('{"op": "auth", "token": "' + "x" * (64 << 10) + '"}')
            with pytest.raises(ConnectionClosed) as e:
                await ws.recv()
            assert e.value.rcvd.code == 1009, e.value.rcvd
            assert "before authentication is capped at 4096 bytes" in e.value.rcvd.reason
        await still_serving(box)
    run(go(), 30)
    assert box.alive()


def test_a_small_first_frame_still_authenticates(box):
    # The cap leaves room for the auth frame itself.
    async def go():
        async with ws_connect(box, header=False) as ws:
            s = Session(ws)
            assert (await s.request("auth", token=box.token))["ok"] is True
            assert (await s.request("ping"))["pong"] is True
    run(go(), 30)


def test_control_after_auth_a_512_kib_frame_is_accepted(box):
    async def go():
        async with ws_connect(box, header=False) as ws:
            s = Session(ws)
            assert (await s.request("auth", token=box.token))["ok"] is True
            r = await s.request("ping", pad="x" * (512 << 10))
            assert r["ok"] is True and r["pong"] is True, r
    run(go(), 30)


def test_the_connection_past_the_bound_is_refused_while_the_others_are_open(box):
    async def go():
        held = []
        try:
            for _ in range(MAX_UNAUTHENTICATED):
                held.append(await ws_connect(box, header=False))
            with pytest.raises(InvalidStatus) as e:
                await ws_connect(box, header=False)
            assert e.value.response.status_code == 503
            assert b"too many unauthenticated connections (64)" in e.value.response.body
            # A client with the token in its header is not held up by them.
            await still_serving(box)
            # One goes: there is room for one more.
            await held.pop().close()
            deadline = time.monotonic() + 20
            while True:  # the server frees the slot when it sees the close: retry until it has
                try:
                    held.append(await ws_connect(box, header=False))
                    break
                except InvalidStatus:
                    assert time.monotonic() < deadline, "the closed connection's slot was never freed"
                    await asyncio.sleep(0.1)
        finally:
            await asyncio.gather(*(ws.close() for ws in held), return_exceptions=True)
    run(go(), 60)
    assert box.alive()


def test_authenticating_frees_the_slot(box):
    async def go():
        held = []
        try:
            for _ in range(MAX_UNAUTHENTICATED):
                held.append(await ws_connect(box, header=False))
            s = Session(held[0])
            assert (await s.request("auth", token=box.token))["ok"] is True
            held.append(await ws_connect(box, header=False))  # the 65th, now the 64th unauthenticated
            assert (await s.request("ping"))["pong"] is True
        finally:
            await asyncio.gather(*(ws.close() for ws in held), return_exceptions=True)
    run(go(), 60)


def test_an_unauthenticated_connection_is_closed_at_its_deadline(box):
    async def go():
        async with ws_connect(box, header=False) as ws:
            t0 = time.monotonic()
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            took = time.monotonic() - t0
            assert 5 < took < 25, took
    run(go(), 40)
