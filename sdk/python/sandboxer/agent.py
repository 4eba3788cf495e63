"""The agent side of the agent channel (checkpoint/README.md, "The agent channel"). Standard
library only.

The supervisor gives the agent a pipe pair instead of the box token: `SANDBOXER_CHANNEL_FD` names
the fd the agent writes requests to and the fd it reads replies from, as `REQ,REPLY` (one number
names a single bidirectional fd). Both directions carry JSON lines. Requests:

    {"id": 1, "op": "whoami"}
    {"id": 2, "op": "checkpoint", "name": "before-step-3"}
    {"id": 3, "op": "event", "event": {"type": "agent.note", ...}}
    {"id": 4, "op": "fork", "n": 4}                  (checkpoint, then 4 live copies)
    {"id": 5, "op": "restore", "snapshot": "s-..."}  (one more copy of a snapshot)
    {"id": 6, "op": "snapshot.list"} / {"id": 7, "op": "snapshot.delete", "snapshot": "s-..."}

Replies have the WebSocket API's shape: `{"id", "ok": true, ...}` or `{"id", "ok": false,
"error": {"code", "message"}}` (`id` null when the request's was unreadable). After a restore or
fork, the first line on the reply fd is an identity line with neither `id` nor `ok` (box, branch,
parent, snapshot, index, mode); it is kept in `Channel.identity`. tests/protocol/channel.json
holds the requests and replies this module and the supervisor are both checked against.
"""
from __future__ import annotations

import json
import os
import random
import threading
from typing import Any, Callable

__all__ = ["Channel", "ChannelError", "channel", "whoami", "checkpoint", "fork", "event", "branch_info",
           "on_restore"]

RestoreHook = Callable[[dict[str, Any]], None]
_restore_hooks: list[RestoreHook] = []


def on_restore(fn: RestoreHook) -> RestoreHook:
    """Registers `fn(identity)` to run in a copy right after it is restored (a fork, a restore, a
    checkpoint that returns in a copy), before the channel call that was under way returns; usable
    as a decorator. `identity` is the copy's identity line (box, branch, parent, snapshot, index,
    mode). Before the hooks run, the module reseeds `random` from the kernel: a copy's memory is
    its parent's, so without it every copy would draw the same "random" numbers. What the hooks
    are for: reopening connections (a copy's TCP connections were closed at its restore), seeding
    generators of their own, dropping caches keyed by pid or hostname.

    A copy made while the agent was not in a channel call (an operator's `fork`) runs the hooks at
    its next channel call, when the identity line is read."""
    _restore_hooks.append(fn)
    return fn


def _restored(identity: dict[str, Any]) -> None:
    random.seed()  # from os.urandom: this copy's own sequence from here on
    for fn in list(_restore_hooks):
        fn(identity)

BRANCH_JSON = "/run/sandboxer/branch.json"


def branch_info(path: str = BRANCH_JSON) -> dict[str, Any]:
    """Who this branch is, from its own filesystem (written into each copy before its restore)."""
    with open(path) as f:
        return json.load(f)


class ChannelError(Exception):
    """A request on the channel failed: `code` and `message` as the supervisor sent them."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def parse_fds(spec: str) -> tuple[int, int]:
    """(request fd, reply fd) from a SANDBOXER_CHANNEL_FD value: "N" or "REQ,REPLY"."""
    parts = [p.strip() for p in spec.replace(":", ",").split(",")]
    try:
        fds = [int(p) for p in parts]
    except ValueError:
        raise ChannelError("bad_channel", f"SANDBOXER_CHANNEL_FD={spec!r} is not an fd or a pair REQ,REPLY") from None
    if len(fds) == 1:
        return fds[0], fds[0]
    if len(fds) == 2:
        return fds[0], fds[1]
    raise ChannelError("bad_channel", f"SANDBOXER_CHANNEL_FD={spec!r} names {len(fds)} fds, expected 1 or 2")


class Channel:
    """The agent's channel to its supervisor. Thread-safe: one request at a time."""

    def __init__(self, spec: str | None = None) -> None:
        spec = spec if spec is not None else os.environ.get("SANDBOXER_CHANNEL_FD")
        if not spec:
            raise ChannelError("no_channel", "SANDBOXER_CHANNEL_FD is not set: not running under sandboxer")
        self._req_fd, self._reply_fd = parse_fds(spec)
        self._buf = b""
        self._next_id = 1
        self._lock = threading.Lock()
        self.identity: dict[str, Any] | None = None
        """The last identity line (sent after a restore or fork), or None."""

    def _read_line(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            chunk = os.read(self._reply_fd, 65536)
            if not chunk:
                raise ChannelError("channel_closed", "the supervisor closed the channel")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ChannelError("protocol", f"channel line is not a JSON object: {line[:200]!r}")
        return obj

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Sends one request and returns its reply; raises ChannelError when it is not ok."""
        if "id" in fields:
            raise ValueError("a request field cannot be named id: that is the request's own id")
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            data = (json.dumps({"id": rid, "op": op, **fields}, separators=(",", ":")) + "\n").encode()
            view = memoryview(data)
            while view:
                view = view[os.write(self._req_fd, view):]
            restored = None
            while True:
                reply = self._read_line()
                if "id" not in reply and "ok" not in reply:
                    self.identity = restored = reply
                    continue
                if reply.get("id") not in (rid, None):
                    continue  # a reply to a request that an earlier copy of this process made
                break
        if restored is not None:
            _restored(restored)  # outside the lock: a hook may use the channel
        if not reply.get("ok", False):
            err = reply.get("error") or {}
            raise ChannelError(str(err.get("code", "unknown")), str(err.get("message", "")))
        return reply

    def whoami(self) -> dict[str, Any]:
        """Who this copy is: box, branch, parent, snapshot, index, mode."""
        reply = self.request("whoami")
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def checkpoint(self, name: str, leave_running: bool = True) -> dict[str, Any]:
        """Checkpoints this agent; returns when the checkpoint is taken. In a restored copy, the
        call returns there too, with `copy` true (and `identity` says who the copy is). With
        leave_running=False the original ends once its memory and files are saved."""
        return self.request("checkpoint", name=name, leave_running=leave_running)

    def fork(self, n: int, name: str = "") -> dict[str, Any]:
        """Checkpoints this agent and starts n live copies of it in this box. Returns in the
        original (`copy` false, `copies` lists the new branches, `snapshot` names the checkpoint)
        and in each copy (`copy` true, `branch`, `index`, `snapshot`). The copies run from before
        the checkpoint's archive is sealed; this returns in them, as in the original, once it is."""
        return self.request("fork", n=n, name=name)

    def restore(self, snapshot: str) -> dict[str, Any]:
        """Restores `snapshot` once more in this box, as a new branch; returns its `copies`."""
        return self.request("restore", snapshot=snapshot)

    def snapshots(self) -> list[dict[str, Any]]:
        """This box's snapshots (their manifests, archive size and hash)."""
        return self.request("snapshot.list")["snapshots"]

    def delete_snapshot(self, snapshot: str) -> None:
        """Deletes `snapshot` (its archive and its extracted copy)."""
        self.request("snapshot.delete", snapshot=snapshot)

    def event(self, type: str, **fields: Any) -> dict[str, Any]:
        """Writes a custom event of `type` with `fields` into the box's journal."""
        return self.request("event", event={"type": type, **fields})


_default: Channel | None = None


def channel() -> Channel:
    """The process-wide channel from SANDBOXER_CHANNEL_FD."""
    global _default
    if _default is None:
        _default = Channel()
    return _default


def whoami() -> dict[str, Any]:
    """`channel().whoami()`."""
    return channel().whoami()


def checkpoint(name: str) -> dict[str, Any]:
    """`channel().checkpoint(name)`."""
    return channel().checkpoint(name)


def fork(n: int, name: str = "") -> dict[str, Any]:
    """`channel().fork(n, name)`."""
    return channel().fork(n, name)


def event(type: str, **fields: Any) -> dict[str, Any]:
    """`channel().event(type, **fields)`."""
    return channel().event(type, **fields)
