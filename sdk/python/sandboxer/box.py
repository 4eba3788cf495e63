"""`Box`: a client of one sandboxer box over the `sandboxer.v1` WebSocket protocol."""
from __future__ import annotations

import asyncio
import itertools
import os
import ssl as ssl_module
from typing import Any, Callable, Sequence

from . import frames
from .connection import Connection, check_url, open_ws, unreachable
from .errors import AuthError, ConnectionLost, ProtocolError
from .events import Event, EventStream
from .fs import FileSystem, _Receiver, _env_text_or_b64, _list_text_or_b64, _text_or_b64
from .process import Process
from .tokens import resolve_token

_proc_counter = itertools.count(1)


class Box:
    """A connected box. Create one with `await Box.connect(url, token)`; close it with
    `await box.close()` or use it as `async with await Box.connect(...) as box:`.

    Requests go over one control connection; each `events()` stream and each process handle
    follows the journal over a connection of its own, so a slow event reader never delays a
    request and a reconnect never loses a reply.
    """

    def __init__(self, url: str, token: str, conn: Connection, *, auth_frame: bool = False,
                 ssl: ssl_module.SSLContext | None = None) -> None:
        self.url = url
        self._token = token
        self._auth_frame = auth_frame
        self._ssl = ssl
        self._conn = conn
        self._streams: set[EventStream] = set()
        self._procs: list[Process] = []
        self.fs = FileSystem(self)
        """File operations: `box.fs.read/write/list/stat/remove`."""

    @classmethod
    async def connect(cls, url: str, token: str | None = None, *, token_file: str | None = None,
                      auth_frame: bool = False, open_timeout: float = 10.0,
                      ssl: ssl_module.SSLContext | None = None) -> "Box":
        """Connects to the box at `url` (`ws://host:port` or `wss://...`).

        The token is `token`, else the contents of `token_file`, else `$SANDBOXER_TOKEN`, else the
        CLI's token store for this URL (`$XDG_STATE_HOME/sandboxer/tokens/`). It is sent as an
        `Authorization: Bearer` header, or as an `auth` first frame when `auth_frame` is set.
        For wss://, `ssl` is the context that verifies the server (default: the system's CAs).
        Raises AuthError when the server refuses it, ConnectionLost when the box is unreachable,
        ValueError for a URL that is not ws:// or wss://.
        """
        check_url(url)
        try:
            tok = resolve_token(url, token, token_file)
        except AuthError as e:
            # A box that ended removed the token it stored: where nothing answers either, that is
            # the news (a box started by `sandboxer run --listen` that has exited).
            why = await unreachable(url)
            if why is None:
                raise
            raise ConnectionLost(f"{e.message}; and no box answers at {url}: {why} (a box removes the token it "
                                 "stored when it ends)") from None
        ws = await open_ws(url, tok, auth_frame=auth_frame, open_timeout=open_timeout, ssl=ssl)
        box = cls(url, tok, Connection(ws), auth_frame=auth_frame, ssl=ssl)
        if auth_frame:
            # The server answers a refused auth frame with close 4401: make that visible here
            # rather than at the first request, by a round trip that needs authentication.
            await box.stats()
        return box

    async def __aenter__(self) -> "Box":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the control connection, every open event stream and every process handle
        (the box and its processes keep running)."""
        for p in list(self._procs):
            await p.close()
        for s in list(self._streams):
            await s.close()
        await self._conn.close()

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Sends any operation and returns its reply; raises SandboxerError (with the server's
        `code` and `message`) when the reply is `ok: false`. Fields set to None are left out;
        `id` and `op` are the envelope's and cannot be fields (ValueError)."""
        return await self._conn.request(op, fields)

    # -- events ---------------------------------------------------------------------------

    def events(self, since: int = 0, branch: str | None = None, *, reconnect_timeout: float = 30.0,
               where: Callable[[Event], bool] | None = None) -> EventStream:
        """Every event with seq > `since` (of `branch` only, when given), then the live stream.

        Use as `async for ev in box.events(since=N): ...`. The stream reconnects by itself (after
        a close 4008 `resume_after=N` or a lost connection) and resumes after the last seq it
        yielded: no gap, no duplicate. `where` filters events client-side (seq tracking still sees
        every event). Close it with `await stream.close()` or `async with box.events() as s:`.
        """
        return EventStream(self, since, branch, reconnect_timeout=reconnect_timeout, where=where)

    # -- processes ------------------------------------------------------------------------

    async def exec(self, argv: Sequence[str | bytes], *, proc: str | None = None,
                   env: dict[str, str | bytes] | None = None,
                   cwd: str | bytes | None = None, tty: bool = False, stdin: bool = False,
                   cols: int | None = None, rows: int | None = None,
                   branch: str | None = None, since: int | None = None) -> Process:
        """Starts `argv` in the box and returns its handle with output streaming in.

        `proc` is the process id (chosen here when None); exec is idempotent per id: the same id
        again returns a handle on the existing process (`handle.reply["existing"]`; an ended one
        while it is among the box's last 1,000 ended processes). `stdin`
        keeps its stdin open for `handle.write()`; `tty` gives it a pty (of `cols` x `rows`,
        80x24 unless given). The handle follows the
        journal from `since` (default: just before the reply's `started_seq`) and keeps this
        process's events. The command's words, `env`'s values and `cwd` are text or bytes: any
        that is not UTF-8 goes as its bytes.
        """
        if not argv:
            raise ValueError("exec needs a non-empty argv")
        proc = proc or f"py-{os.getpid()}-{next(_proc_counter)}"
        reply = await self._conn.request("exec", {
            "proc": proc, **_list_text_or_b64("argv", argv), **_env_text_or_b64(env),
            **(_text_or_b64("cwd", cwd) if cwd is not None else {}),
            "tty": tty, "stdin": stdin, "cols": cols, "rows": rows, "branch": branch,
        })
        start = since
        if start is None:
            # The reply names the seq of `proc.started`, the process's first event: the handle
            # follows the journal from there. Without it, the whole journal is scanned once.
            s = reply.get("started_seq")
            start = s - 1 if isinstance(s, int) and s > 0 else 0
        # The server filters by the process's branch; this handle keeps the process's events.
        b = reply.get("branch")
        stream = EventStream(self, start, b if isinstance(b, str) else branch,
                             where=lambda e: e.get("proc") == proc)
        p = Process(self, proc, reply, stream)
        self._procs.append(p)
        return p

    # Process ids are per branch: `branch` says which branch's `proc`; without it the box takes
    # the one process of that id, and refuses (`ambiguous_proc`) when several branches have one.

    async def stdin(self, proc: str, data: bytes | str = b"", *, eof: bool = False,
                    branch: str | None = None) -> None:
        """Writes `data` to the stdin of process `proc`; `eof` closes it after the data."""
        fields: dict[str, Any] = {"proc": proc, **(_text_or_b64("data", data) if data else {})}
        if eof:
            fields["eof"] = True
        if branch is not None:
            fields["branch"] = branch
        await self._conn.request("stdin", fields)

    async def signal(self, proc: str, signal: str | int, *, branch: str | None = None) -> None:
        """Sends `signal` (a name like "TERM" or a number) to process `proc`."""
        fields: dict[str, Any] = {"proc": proc, "signal": signal}
        if branch is not None:
            fields["branch"] = branch
        await self._conn.request("signal", fields)

    async def resize(self, proc: str, cols: int, rows: int, *, branch: str | None = None) -> None:
        """Sets the pty size of process `proc`."""
        fields: dict[str, Any] = {"proc": proc, "cols": cols, "rows": rows}
        if branch is not None:
            fields["branch"] = branch
        await self._conn.request("resize", fields)

    # -- the box --------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Resource use of the box and of each process (cpu, memory, pids, disk)."""
        reply = await self._conn.request("stats")
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def shutdown(self, grace: float | str | None = None) -> dict[str, Any]:
        """Ends the box: TERM to every process, `grace` (seconds, or a duration like "3s"),
        then KILL. Returns the reply; the box then closes its connections."""
        return await self._conn.request("shutdown", {"grace": grace})

    # -- checkpoints and snapshots ------------------------------------------------------------

    async def checkpoint(self, name: str | None = None, *, leave_running: bool = True,
                         branch: str | None = None) -> dict[str, Any]:
        """Checkpoints the agent (memory and files at one instant); returns the reply with the
        snapshot id."""
        return await self._conn.request("checkpoint", {"name": name, "leave_running": leave_running,
                                                       "branch": branch})

    async def restore(self, snapshot: str, index: int | None = None) -> dict[str, Any]:
        """Restores snapshot `snapshot` in this box, as a new branch. With `index`, an idle box
        (`sandboxer-init --idle`) becomes that copy of the snapshot instead, and ends with it."""
        fields: dict[str, Any] = {"snapshot": snapshot}
        if index is not None:
            fields["index"] = index
        return await self._conn.request("restore", fields)

    async def fork(self, snapshot: str | None = None, n: int = 1, *, branch: str | None = None,
                   name: str | None = None) -> dict[str, Any]:
        """Starts `n` copies of snapshot `snapshot` in this box, each a branch of its own. With
        `branch` instead: a live checkpoint of that branch (named `name`) and `n` copies of it,
        started from its images before its archive is sealed; the reply names the snapshot."""
        if (snapshot is None) == (branch is None):
            raise ValueError("fork: give a snapshot or a branch, one of them")
        if branch is None:
            if name is not None:
                raise ValueError("fork: name names the checkpoint of a branch: only with branch")
            return await self._conn.request("fork", {"snapshot": snapshot, "n": n})
        fields: dict[str, Any] = {"branch": branch, "n": n}
        if name is not None:
            fields["name"] = name
        return await self._conn.request("fork", fields)

    async def snapshots(self) -> list[dict[str, Any]]:
        """The snapshots the box holds."""
        reply = await self._conn.request("snapshot.list")
        snaps = reply.get("snapshots")
        if not isinstance(snaps, list):
            raise ProtocolError(f"snapshot.list reply has no snapshots list: {reply!r}", op="snapshot.list")
        return snaps

    async def delete_snapshot(self, snapshot: str) -> None:
        """Deletes snapshot `snapshot`."""
        await self._conn.request("snapshot.delete", {"snapshot": snapshot})

    async def export_snapshot(self, snapshot: str, base: str | None = None) -> bytes:
        """The archive of snapshot `snapshot` (received in binary frames). With `base`, a delta
        instead: only the chunks `base` lacks, for a box that has `base` (import_snapshot takes it)."""
        recv = _Receiver(f"snapshot.export {snapshot}")
        fields = {"snapshot": snapshot} | ({"base": base} if base else {})
        reply = await self._conn.request("snapshot.export", fields, sink=recv)
        closed = asyncio.ensure_future(self._conn.wait_closed())
        try:
            return await recv.result(closed, reply)
        finally:
            closed.cancel()
            self._conn.drop_sink(reply["id"])

    async def import_snapshot(self, archive: bytes) -> dict[str, Any]:
        """Uploads a snapshot archive (in binary frames); returns the reply with its id."""
        async def upload(rid: int) -> None:
            for frame in frames.iter_chunks(rid, archive):
                if self._conn.replied(rid):
                    break
                await self._conn.send_binary(frame)

        return await self._conn.request("snapshot.import", {"size": len(archive)}, after_send=upload)
