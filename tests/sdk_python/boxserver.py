"""A real sandboxer-init serving the WebSocket API on loopback, for the Python SDK's tests, and a
TCP relay whose connections a test can cut to simulate a lost network."""
from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
BUILD = pathlib.Path(os.environ.get("SANDBOXER_BUILD", ROOT / "build"))
INIT = BUILD / "bin" / "sandboxer-init"
PROBE = BUILD / "bin" / "sbx-testprobe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BoxServer:
    """sandboxer-init as PID 1 of a fresh pid namespace, `--listen 127.0.0.1:PORT` with a token
    file, running `argv` as its agent."""

    def __init__(self, tmp: pathlib.Path, argv: list[str], extra: list[str] | None = None) -> None:
        self.tmp = tmp
        self.token = secrets.token_hex(16)
        self.token_file = tmp / "token"
        self.token_file.write_text(self.token + "\n")
        os.chmod(self.token_file, 0o600)
        self.state_dir = tmp / "state"
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.stderr_path = tmp / "init.stderr"
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", str(INIT),
               "--state-dir", str(self.state_dir), "--listen", f"127.0.0.1:{self.port}",
               "--token-file", str(self.token_file), *(extra or []), "--", *argv]
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._err, start_new_session=True)
        self._wait_listening(15)

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxer-init exited {self.proc.returncode}: {self.stderr()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"sandboxer-init did not listen on {self.port}: {self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._err.close()


class Relay:
    """A TCP relay 127.0.0.1:port -> target; `cut()` aborts every connection it carries."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cuts = 0
        self._conns: set[asyncio.Transport] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def start(self) -> "Relay":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.transport.abort()
            return
        ts = {cw.transport, sw.transport}
        self._conns |= ts

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                w.transport.abort()

        await asyncio.gather(pump(cr, sw), pump(sr, cw))
        self._conns -= ts

    def cut(self) -> None:
        """Drops every relayed connection at once (no close frame: a lost network)."""
        self.cuts += 1
        for t in list(self._conns):
            t.abort()
        self._conns.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def run(coro, timeout=60):
    """Runs a coroutine to completion within `timeout` seconds."""
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())
