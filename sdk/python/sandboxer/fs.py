"""Files of the box: `fs.read / fs.write / fs.list / fs.stat / fs.mkdir / fs.symlink / fs.chmod /
fs.rename / fs.remove`,
content in binary frames (see frames.py) of at most 1 MiB each."""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import base64

from . import frames
from .errors import ProtocolError

if TYPE_CHECKING:
    from .box import Box


INLINE_MAX = 32 << 10  # fs.write content up to this size goes inside the request


class _Receiver:
    """Collects the binary frames of one transfer; checks they are contiguous."""

    def __init__(self, what: str, base: int = 0) -> None:
        self.what = what
        self.base = base
        self.parts: list[bytes] = []
        self.size = 0
        self.done = asyncio.Event()
        self.error: str | None = None

    def __call__(self, chunk: frames.Chunk) -> None:
        if self.done.is_set():
            self.error = self.error or f"{self.what}: a binary frame arrived after the last one"
            return
        if chunk.offset != self.base + self.size:
            self.error = self.error or f"{self.what}: frame at offset {chunk.offset}, expected {self.base + self.size}"
        self.parts.append(chunk.data)
        self.size += len(chunk.data)
        if chunk.last:
            self.done.set()

    async def result(self, conn_closed: "asyncio.Future[Any] | None", reply: dict[str, Any]) -> bytes:
        expected = reply.get("length", reply.get("size"))
        # Content may follow the reply; an empty file may come as no frame at all.
        if not self.done.is_set() and not (expected == 0 and not self.parts):
            waiter = asyncio.ensure_future(self.done.wait())
            waits: set[asyncio.Future[Any]] = {waiter}
            if conn_closed is not None:
                waits.add(conn_closed)
            finished, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if waiter not in finished:
                assert conn_closed is not None
                raise conn_closed.result()
        if self.error:
            raise ProtocolError(self.error)
        data = b"".join(self.parts)
        if isinstance(expected, int) and expected != len(data):
            raise ProtocolError(f"{self.what}: reply says {expected} bytes, frames carried {len(data)}")
        return data


Path = str | bytes


LIST_PAGE = 10000
"""Entries a request of FileSystem.list asks for."""


def _entry_name(entry: dict[str, Any]) -> bytes:
    """An fs.list entry's name as the bytes on disk (name_b64 where the box gave them)."""
    if isinstance(entry.get("name_b64"), str):
        return base64.b64decode(entry["name_b64"])
    if isinstance(entry.get("name"), str):
        return entry["name"].encode("utf-8", "surrogateescape")
    raise ProtocolError(f"fs.list entry without a name: {entry!r}", op="fs.list")


def _text_or_b64(key: str, value: str | bytes) -> dict[str, str]:
    """A field of text or bytes (a path, an entry's `name_b64` decoded; stdin's or a file's
    content): as `key` when the bytes are UTF-8, else as `key`_b64 (base64 of the bytes), which
    the box takes in place of `key`."""
    # A str may carry bytes that are not UTF-8 as surrogate escapes (os.fsdecode, sys.argv).
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
    try:
        return {key: raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {key + "_b64": base64.b64encode(raw).decode("ascii")}


def _list_text_or_b64(key: str, values: Sequence[str | bytes]) -> dict[str, list[str]]:
    """A list of such fields (exec's argv) as one: `key`, a list of text, where every item is
    UTF-8, else `key`_b64, every item's base64."""
    raw = [v if isinstance(v, bytes) else v.encode("utf-8", "surrogateescape") for v in values]
    try:
        return {key: [r.decode("utf-8") for r in raw]}
    except UnicodeDecodeError:
        return {key + "_b64": [base64.b64encode(r).decode("ascii") for r in raw]}


def _env_text_or_b64(env: Mapping[str, str | bytes] | None) -> dict[str, dict[str, str]]:
    """exec's environment: `env` where every value is UTF-8, else `env_b64` with every value's
    base64 (the names are text either way)."""
    if not env:
        return {}
    fields = _list_text_or_b64("v", list(env.values()))
    if "v" in fields:
        return {"env": dict(zip(env.keys(), fields["v"]))}
    return {"env_b64": dict(zip(env.keys(), fields["v_b64"]))}


class FileSystem:
    """`box.fs`: the files of the box, confined by the server to the roots its profile allows.
    Every path is text or bytes: a name that is not UTF-8 (an entry's `name_b64`, decoded) is
    given as its bytes."""

    def __init__(self, box: "Box") -> None:
        self._box = box

    async def read(self, path: Path, *, offset: int = 0, length: int | None = None,
                   branch: str | None = None) -> bytes:
        """The content of the file at `path` (`/workspace/...` or `/tmp/...`): all of it, or
        `length` bytes from `offset`."""
        conn = self._box._conn
        recv = _Receiver(f"fs.read {path!r}" if isinstance(path, bytes) else f"fs.read {path}", offset)
        reply = await conn.request("fs.read", {**_text_or_b64("path", path), "offset": offset or None, "length": length,
                                               "branch": branch}, sink=recv)
        closed = asyncio.ensure_future(conn.wait_closed())
        try:
            return await recv.result(closed, reply)
        finally:
            closed.cancel()
            conn.drop_sink(reply["id"])

    async def write(self, path: Path, data: bytes | str, *, mode: int | None = None, append: bool = False,
                    atomic: bool = False, branch: str | None = None, inline: bool | None = None,
                    chunk_size: int = frames.MAX_CHUNK) -> dict[str, Any]:
        """Creates or replaces (or with `append`, extends) the file at `path` with `data`;
        returns the reply (`size`, `path`) once the server has written every byte. `mode` sets
        the permission bits of a new file. With `atomic`, the data goes to a new file beside it,
        renamed over it once whole: a reader sees the old file or the new one, never a part, and a
        write that fails leaves the old one as it was (its mode and owner carry over unless `mode`
        says). Content travels in binary frames after the request, or inside the request
        (`data` / `data_b64`) when `inline` (default: up to 32 KiB)."""
        if isinstance(data, str):
            data = data.encode()
        conn = self._box._conn
        fields: dict[str, Any] = {**_text_or_b64("path", path), "mode": mode, "append": append or None,
                                  "atomic": atomic or None, "branch": branch}
        if inline if inline is not None else len(data) <= INLINE_MAX:
            return await conn.request("fs.write", {**fields, **_text_or_b64("data", data)})

        async def upload(rid: int) -> None:
            for frame in frames.iter_chunks(rid, data, chunk_size):
                if conn.replied(rid):
                    break  # refused (or done) early: the rest would only be ignored
                await conn.send_binary(frame)

        return await conn.request("fs.write", fields, after_send=upload)

    async def list(self, path: Path = "/workspace", *, branch: str | None = None) -> list[dict[str, Any]]:
        """The entries of the directory at `path`: name, type, size and mode as the server reports
        them, a symlink's text in target, and name_b64 (target_b64) for the bytes of a name (a
        symlink's text) that is not UTF-8. Sorted by name (its bytes), asked for LIST_PAGE at a
        time: no reply holds a whole large directory. (A box that does not page answers whole,
        in the directory's order.)"""
        entries: list[dict[str, Any]] = []
        after: bytes | None = None
        while True:
            page, more = await self.list_page(path, limit=LIST_PAGE, after=after, branch=branch)
            entries += page
            if not more or not page:
                return entries
            last = _entry_name(page[-1])
            if after is not None and last <= after:
                raise ProtocolError(f"fs.list pages that do not go on past {last!r}", op="fs.list")
            after = last

    async def list_page(self, path: Path = "/workspace", *, limit: int, after: str | bytes | None = None,
                        branch: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """One page of the directory at `path`: the first `limit` entries (at most 100,000) whose
        names come after `after` in byte order, sorted, and whether more follow. The next page
        starts after the last name of this one (its name_b64 decoded where it has one)."""
        fields = {**_text_or_b64("path", path), "limit": limit, "branch": branch}
        if after is not None:
            fields |= _text_or_b64("after", after)
        reply = await self._box._conn.request("fs.list", fields)
        page = reply.get("entries")
        if not isinstance(page, list) or not all(isinstance(e, dict) for e in page):
            raise ProtocolError(f"fs.list reply has no entries list: {reply!r}", op="fs.list")
        return page, reply.get("more") is True

    async def stat(self, path: Path, *, follow: bool = True, branch: str | None = None) -> dict[str, Any]:
        """Type, size, mode and mtime of `path` (the reply without id and ok). With `follow`
        False, of the entry itself: a symlink there is not followed, and its text is in `target`
        (its bytes in `target_b64` where they are not UTF-8)."""
        reply = await self._box._conn.request(
            "fs.stat", {**_text_or_b64("path", path), "follow": None if follow else False, "branch": branch})
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def mkdir(self, path: Path, *, mode: int | None = None, branch: str | None = None) -> None:
        """Creates the directory `path`, with the permission bits `mode` (0o755 if None). A
        directory there already is kept as it is."""
        await self._box._conn.request("fs.mkdir", {**_text_or_b64("path", path), "mode": mode, "branch": branch})

    async def symlink(self, path: Path, target: str | bytes, *, branch: str | None = None) -> None:
        """Creates a symlink at `path` whose text is `target` (kept as given; the fs operations
        resolve it beneath its root, as any other). Bytes that are not UTF-8 go as they are."""
        await self._box._conn.request("fs.symlink", {**_text_or_b64("path", path), **_text_or_b64("target", target),
                                                     "branch": branch})

    async def chmod(self, path: Path, mode: int, *, branch: str | None = None) -> None:
        """Sets the permission bits of `path` (0 to 0o7777; a symlink there: of what it names,
        inside the same root)."""
        await self._box._conn.request("fs.chmod", {**_text_or_b64("path", path), "mode": mode, "branch": branch})

    async def rename(self, src: Path, dst: Path, *, replace: bool = False, branch: str | None = None) -> None:
        """Moves the entry at `src` (itself: a symlink moves as a link) to `dst`, in the same root
        (/workspace or /tmp). An entry at `dst` stays (error `exists`) unless `replace`."""
        await self._box._conn.request("fs.rename", {**_text_or_b64("from", src), **_text_or_b64("to", dst),
                                                    "replace": replace or None, "branch": branch})

    async def remove(self, path: Path, *, recursive: bool = False, branch: str | None = None) -> None:
        """Removes a file, or a directory (`recursive` for one that is not empty)."""
        await self._box._conn.request("fs.remove", {**_text_or_b64("path", path), "recursive": recursive or None,
                                                    "branch": branch})
