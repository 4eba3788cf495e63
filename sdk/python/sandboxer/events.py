"""The event stream: `subscribe{since, branch}` on a connection of its own, resumed from the last
seq it delivered whenever the connection drops (close 4008 `resume_after=N`, or a broken
connection), so its consumer sees every event once, in order."""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from .connection import CLOSE_AUTH, CLOSE_SLOW, classify, close_info, close_ws, lost_error, open_ws
from .errors import AuthError, ConnectionLost, SandboxerError

if TYPE_CHECKING:
    from .box import Box

Event = dict[str, Any]


def parse_resume_after(reason: str) -> int | None:
    """N of a close reason `resume_after=N`, or None when the reason has another shape."""
    key, sep, value = reason.strip().partition("=")
    if sep and key == "resume_after" and value.isdigit():
        return int(value)
    return None


class EventStream:
    """An async iterator of the box's events after `since` (live once the history is sent).

    It owns one WebSocket. When that connection drops it reconnects and resubscribes with
    `since` = the last seq it yielded, and skips any event it already yielded, so a consumer sees
    exactly the sequence an uninterrupted client would. It ends (StopAsyncIteration) when the
    server closes the connection normally (1000/1001: the box ended) or after `close()`; it raises
    ConnectionLost when it cannot reconnect within `reconnect_timeout` seconds, AuthError when the
    token is refused, SandboxerError when the server rejects the subscription.
    """

    def __init__(self, box: "Box", since: int = 0, branch: str | None = None, *,
                 reconnect_timeout: float = 30.0, where: Callable[[Event], bool] | None = None) -> None:
        self._box = box
        self.since = since
        self.branch = branch
        self.last_seq = since
        self.reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        self.closes: list[tuple[int | None, str]] = []
        """(code, reason) of every close or loss of its connection (code None: no close frame)."""
        self._idle_losses = 0  # losses in a row with no event in between: back off
        self._where = where
        self._ws: ClientConnection | None = None
        self._closed = False
        self._sub_id = 0

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __aenter__(self) -> "EventStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the stream's connection; iteration then ends."""
        self._closed = True
        ws, self._ws = self._ws, None
        self._box._streams.discard(self)
        if ws is not None:
            await close_ws(ws)

    async def _subscribe(self) -> None:
        """Connects and subscribes from `last_seq`, retrying while the box is unreachable."""
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                ws = await open_ws(self._box.url, self._box._token, auth_frame=self._box._auth_frame,
                                   ssl=self._box._ssl)
                break
            except AuthError:
                raise
            except ConnectionLost:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        self._sub_id += 1
        req: dict[str, Any] = {"id": self._sub_id, "op": "subscribe", "since": self.last_seq}
        if self.branch is not None:
            req["branch"] = self.branch
        try:
            await ws.send(json.dumps(req))
        except ConnectionClosed:
            pass  # recv() sees the close and decides
        self._ws = ws
        self._box._streams.add(self)

    async def __anext__(self) -> Event:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._ws is None:
                await self._subscribe()
            assert self._ws is not None
            try:
                msg = await self._ws.recv()
            except ConnectionClosed as e:
                if self._closed:
                    raise StopAsyncIteration from None
                self._ws = None
                self._box._streams.discard(self)
                code, reason = close_info(e)
                self.closes.append((code, reason))
                if code in (1000, 1001):
                    self._closed = True
                    raise StopAsyncIteration from None
                if code == CLOSE_AUTH:
                    raise lost_error("subscribe", e) from None
                if code == CLOSE_SLOW:
                    # Too slow for the server's queue: the journal has everything. Resume after
                    # the last seq this stream delivered, never after the server's N: frames the
                    # server had sent before the close may have been dropped on our side with the
                    # connection, and N would skip them. Events seen twice are filtered below.
                    pass
                elif self._idle_losses:
                    # A server that keeps dropping us before sending anything: do not spin.
                    await asyncio.sleep(min(0.05 * 2 ** self._idle_losses, 1.0))
                self._idle_losses += 1
                self.reconnects += 1
                continue
            if isinstance(msg, bytes):
                continue
            try:
                obj = json.loads(msg)
            except ValueError:
                continue
            kind = classify(obj)
            if kind == "reply":
                if not obj["ok"] and obj.get("id") == self._sub_id:
                    await self.close()
                    raise SandboxerError.from_reply(obj, "subscribe")
                continue
            if kind != "event":
                continue
            ev: Event = obj
            seq: int = ev["seq"]
            if seq <= self.last_seq:
                continue  # already delivered before a reconnect
            self.last_seq = seq
            self._idle_losses = 0
            if self._where is not None and not self._where(ev):
                continue
            return ev
