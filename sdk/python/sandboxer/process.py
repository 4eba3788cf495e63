"""A process started by `Box.exec`: its output as it streams, its stdin, signals, and its exit."""
from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any, AsyncIterator

from .errors import SandboxerError
from .events import Event, EventStream

if TYPE_CHECKING:
    from .box import Box


def output_bytes(ev: Event) -> bytes:
    """The bytes of a `proc.output` event (`data` is UTF-8 text, `data_b64` raw bytes)."""
    if "data_b64" in ev:
        return base64.b64decode(ev["data_b64"])
    return str(ev.get("data", "")).encode("utf-8")


class Process:
    """Handle of one process of the box, by its client-chosen id `proc`.

    A background task follows the process's events (`proc.started`, `proc.output`,
    `proc.message`, `proc.exited`) from the box's event stream and keeps them, so `output()`
    can be iterated by any number of readers from the start and `wait()` works whether or not
    anyone reads the output.
    """

    def __init__(self, box: "Box", proc: str, reply: dict[str, Any], stream: EventStream) -> None:
        self.box = box
        self.proc = proc
        self.reply = reply
        """The exec reply (`existing: true` with the state when the id already ran)."""
        b = reply.get("branch")
        self.branch: str | None = b if isinstance(b, str) else None
        """The branch the process runs in (process ids are per branch)."""
        self.events: list[Event] = []
        """Every event of this process received so far, in seq order."""
        self.exit: Event | None = None
        """The `proc.exited` event once it arrived."""
        self._stream = stream
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        try:
            async for ev in self._stream:
                self.events.append(ev)
                if ev.get("type") == "proc.exited":
                    self.exit = ev
                self._changed.set()
                if self.exit is not None:
                    break
        except BaseException as e:  # kept for wait()/output() to raise in the caller's task
            self._error = e
        finally:
            await self._stream.close()
            self._changed.set()

    @property
    def done(self) -> bool:
        """True once `proc.exited` arrived."""
        return self.exit is not None

    @property
    def exit_code(self) -> int | None:
        """The exit code, or None while running or when a signal ended the process."""
        return self.exit.get("code") if self.exit else None

    @property
    def exit_signal(self) -> str | None:
        """The name of the signal that ended the process (e.g. "KILL"), or None."""
        return self.exit.get("signal") if self.exit else None

    def _collect(self, stream: str) -> bytes:
        return b"".join(output_bytes(e) for e in self.events
                        if e.get("type") == "proc.output" and e.get("stream") == stream)

    @property
    def stdout(self) -> bytes:
        """All stdout bytes received so far."""
        return self._collect("stdout")

    @property
    def stderr(self) -> bytes:
        """All stderr bytes received so far."""
        return self._collect("stderr")

    @property
    def pty(self) -> bytes:
        """All bytes of the pty (exec with tty=True) received so far."""
        return self._collect("pty")

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The JSON objects the process printed as lines (`proc.message`)."""
        return [e["message"] for e in self.events if e.get("type") == "proc.message"]

    async def _next_change(self, seen: int) -> None:
        self._changed.clear()
        if len(self.events) != seen or self._task.done():
            return
        await self._changed.wait()

    async def iter_events(self) -> AsyncIterator[Event]:
        """Every event of this process, from the first, until `proc.exited` (included)."""
        i = 0
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.exit is not None:
                return
            if self._task.done():
                self._raise_follow_error()
                return
            await self._next_change(i)

    async def output(self) -> AsyncIterator[tuple[str, bytes]]:
        """(stream, bytes) for each output chunk as it arrives, from the first, until exit."""
        async for ev in self.iter_events():
            if ev.get("type") == "proc.output":
                yield str(ev.get("stream")), output_bytes(ev)

    def _raise_follow_error(self) -> None:
        if self._error is not None:
            raise self._error
        raise SandboxerError("connection_closed", f"event stream of {self.proc} ended before proc.exited")

    async def wait(self, timeout: float | None = None) -> Event:
        """Waits for `proc.exited` and returns it (`code` or `signal`, `reason`). Raises
        TimeoutError after `timeout` seconds, SandboxerError when the stream ended first."""
        async with asyncio.timeout(timeout):
            await asyncio.shield(self._task)
        if self.exit is None:
            self._raise_follow_error()
        assert self.exit is not None
        return self.exit

    async def write(self, data: bytes | str) -> None:
        """Sends bytes to the process's stdin (exec with stdin=True or tty=True)."""
        await self.box.stdin(self.proc, data, branch=self.branch)

    async def close_stdin(self) -> None:
        """Closes the process's stdin (it reads EOF)."""
        await self.box.stdin(self.proc, b"", eof=True, branch=self.branch)

    async def signal(self, sig: str | int) -> None:
        """Sends a signal by name ("TERM") or number."""
        await self.box.signal(self.proc, sig, branch=self.branch)

    async def resize(self, cols: int, rows: int) -> None:
        """Sets the pty's size (exec with tty=True)."""
        await self.box.resize(self.proc, cols, rows, branch=self.branch)

    async def close(self) -> None:
        """Stops following the process (it keeps running in the box)."""
        await self._stream.close()
        self._task.cancel()
        try:
            await self._task
        except BaseException:
            pass
