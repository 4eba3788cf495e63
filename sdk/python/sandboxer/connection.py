"""One WebSocket connection to a box: the handshake (subprotocol, bearer token), requests whose
replies are matched by id, and binary frames routed by request id."""
from __future__ import annotations

import asyncio
import json
import logging
import ssl as ssl_module
import urllib.parse
from typing import Any, Callable

from websockets.asyncio.client import ClientConnection, connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from . import frames
from .errors import AuthError, ConnectionLost, ProtocolError, SandboxerError

SUBPROTOCOL = "sandboxer.v1"
CLOSE_AUTH = 4401
CLOSE_SLOW = 4008
MAX_TEXT = 1 << 20

log = logging.getLogger("sandboxer")

BinarySink = Callable[[frames.Chunk], None]


def check_url(url: str) -> None:
    """Refuses a URL that is not ws:// or wss:// with a host, naming what is wrong."""
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("ws", "wss"):
        raise ValueError(f"box URL {url!r}: expected ws://HOST:PORT or wss://HOST:PORT")
    if not p.hostname:
        raise ValueError(f"box URL {url!r} has no host")


async def unreachable(url: str, timeout: float = 2.0) -> str | None:
    """Why a TCP connection to `url`'s host and port is not made ("Connection refused (nothing
    listens on HOST:PORT)", no answer within `timeout`), or None where one is accepted (and
    closed at once). As the CLI's `unreachable` (cli/session.cpp)."""
    p = urllib.parse.urlsplit(url)
    host, port = p.hostname or "", p.port or (443 if p.scheme == "wss" else 80)
    where = f"{host}:{port}"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return f"Connection refused (nothing listens on {where})"
    except asyncio.TimeoutError:
        return f"no answer within {timeout:g} s ({where})"
    except OSError as e:
        return f"{e.strerror or e} ({where})"
    writer.close()
    return None


async def open_ws(url: str, token: str, *, auth_frame: bool = False, open_timeout: float = 10.0,
                  max_queue: int = 16, ssl: ssl_module.SSLContext | None = None) -> ClientConnection:
    """Opens a `sandboxer.v1` WebSocket to `url` with `token` (an Authorization header, or an auth
    first frame when `auth_frame`). `ssl` verifies a wss:// server (default: the system's CAs).
    Raises AuthError on 401, ConnectionLost when unreachable."""
    headers = None if auth_frame else {"Authorization": f"Bearer {token}"}
    extra: dict[str, Any] = {"ssl": ssl} if ssl is not None else {}
    try:
        ws = await ws_connect(url, subprotocols=[SUBPROTOCOL], additional_headers=headers,  # type: ignore[list-item]
                              open_timeout=open_timeout, max_size=frames.HEADER_SIZE + frames.MAX_CHUNK + 1024,
                              max_queue=max_queue, compression=None, ping_interval=20, ping_timeout=20,
                              close_timeout=2, **extra)
    except InvalidStatus as e:
        status = e.response.status_code
        if status == 401:
            raise AuthError(f"{url} refused the token (HTTP 401)") from None
        raise ConnectionLost(f"connect {url}: HTTP {status}") from None
    except (OSError, EOFError, asyncio.TimeoutError, WebSocketException) as e:
        # EOFError: the server closed the TCP connection before answering (e.g. while it exits).
        raise ConnectionLost(f"connect {url}: {e or type(e).__name__}") from None
    if auth_frame:
        await ws.send(json.dumps({"op": "auth", "token": token}))
    return ws


async def close_ws(ws: ClientConnection) -> None:
    """Closes `ws` while reading on (and dropping) what still arrives. The library stops reading
    the socket while frames wait unread, and the server's Close comes after what the kernel
    already holds: without reading on, a busy stream's close ends only at the close timeout."""
    async def drain() -> None:
        try:
            while True:
                await ws.recv()
        except (ConnectionClosed, RuntimeError):
            # RuntimeError: another task is reading (it sees the close itself).
            pass
    reader = asyncio.get_running_loop().create_task(drain())
    try:
        await ws.close()
    finally:
        reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass


def close_info(e: ConnectionClosed) -> tuple[int | None, str]:
    """The close code and reason the server sent, or (None, "") when the connection just broke."""
    if e.rcvd is not None:
        return e.rcvd.code, e.rcvd.reason
    return None, ""


def lost_error(what: str, e: ConnectionClosed) -> SandboxerError:
    """The exception for a connection that closed under `what`: AuthError for 4401."""
    code, reason = close_info(e)
    if code == CLOSE_AUTH:
        return AuthError(f"{what}: the server refused the token (close 4401{': ' + reason if reason else ''})")
    detail = f"close {code}{' ' + reason if reason else ''}" if code is not None else "connection lost"
    return ConnectionLost(f"{what}: {detail}", close_code=code, close_reason=reason)


class Connection:
    """Requests and replies over one WebSocket, with a reader task that routes every incoming
    frame: replies to the waiting request, binary frames to the sink of their request id, events
    to `on_event` (if any)."""

    def __init__(self, ws: ClientConnection, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.ws = ws
        self.on_event = on_event
        self._next_id = 1
        self._pending: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._sinks: dict[int, BinarySink] = {}
        self._closed: SandboxerError | None = None
        self._close_waiters: list[asyncio.Future[None]] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def closed(self) -> SandboxerError | None:
        """Why the connection is closed, or None while it is open."""
        return self._closed

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id = rid + 1 if rid < 0xFFFFFFFF else 1
        return rid

    async def request(self, op: str, fields: dict[str, Any] | None = None, *,
                      sink: BinarySink | None = None, rid: int | None = None,
                      after_send: Callable[[int], Any] | None = None,
                      raise_error: bool = True) -> dict[str, Any]:
        """Sends `{"id", "op", **fields}` and returns its reply. Raises SandboxerError with the
        server's code on `ok: false` (unless not `raise_error`). `sink` receives the request's
        binary frames until `drop_sink(id)` (the reply's `id`): content may follow the reply.
        `after_send(id)` (a coroutine function) runs once the request is sent, e.g. to stream
        binary frames up."""
        if fields and ("id" in fields or "op" in fields):
            raise ValueError("request fields cannot be named id or op: those are the envelope's")
        if self._closed is not None:
            raise self._closed
        rid = self.new_id() if rid is None else rid
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (op, fut)
        if sink is not None:
            self._sinks[rid] = sink
        try:
            msg = {"id": rid, "op": op}
            for k, v in (fields or {}).items():
                if v is not None:
                    msg[k] = v
            try:
                text = json.dumps(msg, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise SandboxerError("bad_request", f"request is not expressible as JSON: {e}", op=op) from None
            if len(text.encode()) > MAX_TEXT:
                raise SandboxerError("too_large", f"request of {len(text)} bytes exceeds the 1 MiB text frame limit", op=op)
            try:
                await self.ws.send(text)
                if after_send is not None:
                    await after_send(rid)
            except ConnectionClosed as e:
                raise self._set_closed(lost_error(op, e)) from None
            reply = await fut
        except BaseException:
            self._sinks.pop(rid, None)
            raise
        finally:
            self._pending.pop(rid, None)
        if not reply.get("ok", False):
            self._sinks.pop(rid, None)
            if raise_error:
                raise SandboxerError.from_reply(reply, op)
        return reply

    def drop_sink(self, rid: int) -> None:
        """Stops routing binary frames of request `rid` (its content may follow its reply, so a
        request with a sink keeps it until the caller has every frame)."""
        self._sinks.pop(rid, None)

    def replied(self, rid: int) -> bool:
        """True once request `rid` has its reply (e.g. an early refusal of an upload)."""
        entry = self._pending.get(rid)
        return entry is None or entry[1].done()

    async def send_binary(self, frame: bytes) -> None:
        try:
            await self.ws.send(frame)
        except ConnectionClosed as e:
            raise self._set_closed(lost_error("send", e)) from None

    async def wait_closed(self) -> SandboxerError:
        """Waits until the connection closes; returns why."""
        if self._closed is None:
            f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._close_waiters.append(f)
            await f
        assert self._closed is not None
        return self._closed

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass
        self._set_closed(ConnectionLost("connection closed by the client", close_code=1000))

    def _set_closed(self, err: SandboxerError) -> SandboxerError:
        if self._closed is None:
            self._closed = err
            for _, fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(err)
            for w in self._close_waiters:
                if not w.done():
                    w.set_result(None)
        return self._closed

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.recv()
                if isinstance(msg, bytes):
                    self._on_binary(msg)
                else:
                    self._on_text(msg)
        except ConnectionClosed as e:
            self._set_closed(lost_error("connection", e))
        except Exception as e:  # a bug in a sink or callback: fail everyone rather than hang
            log.exception("sandboxer connection reader failed")
            self._set_closed(ConnectionLost(f"reader failed: {e!r}"))

    def _on_binary(self, msg: bytes) -> None:
        try:
            chunk = frames.decode_chunk(msg)
        except ValueError as e:
            log.warning("ignoring malformed binary frame: %s", e)
            return
        sink = self._sinks.get(chunk.request_id)
        if sink is None:
            log.warning("binary frame for request %d, which is not waiting for one", chunk.request_id)
            return
        sink(chunk)

    def _on_text(self, msg: str) -> None:
        try:
            obj = json.loads(msg)
        except ValueError:
            log.warning("ignoring a text frame that is not JSON: %.200r", msg)
            return
        if not isinstance(obj, dict):
            log.warning("ignoring a text frame that is not a JSON object: %.200r", msg)
            return
        kind = classify(obj)
        rid = obj.get("id")
        if kind == "reply" and isinstance(rid, int):
            entry = self._pending.get(rid)
            if entry is not None and not entry[1].done():
                entry[1].set_result(obj)
            return
        if kind == "event":
            if self.on_event is not None:
                self.on_event(obj)
            return
        if obj.get("ok") is False:
            # An error reply the server could not tie to a request id (a frame it could not parse).
            log.warning("server error without a request id: %s", obj.get("error"))
            return
        # Anything else (an auth acknowledgement, a field this client does not know) is ignored.


def classify(obj: Any) -> str:
    """What a text frame from the server is: "reply" (has `id` and `ok`), "event" (has `seq`
    and `type`, never `id`), or "other"."""
    if not isinstance(obj, dict):
        return "other"
    if "ok" in obj and "id" in obj:
        return "reply"
    if isinstance(obj.get("seq"), int) and "type" in obj and "id" not in obj:
        return "event"
    return "other"


def check_reply_type(reply: dict[str, Any], key: str, typ: type, op: str) -> Any:
    """`reply[key]` if it has type `typ`; a ProtocolError naming the field otherwise."""
    v = reply.get(key)
    if not isinstance(v, typ):
        raise ProtocolError(f"reply has no {typ.__name__} field {key!r}: {reply!r}", op=op)
    return v
