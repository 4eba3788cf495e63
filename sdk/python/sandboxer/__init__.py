"""sandboxer: an asyncio client for sandboxer boxes.

    from sandboxer import Box

    async with await Box.connect("ws://127.0.0.1:7000") as box:
        p = await box.exec(["sh", "-c", "echo hi"])
        print((await p.wait())["code"], p.stdout)
        async for ev in box.events(since=0):
            print(ev["seq"], ev["type"])

`sandboxer.agent` is the agent-side channel module (standard library only).
"""
from .box import Box
from .errors import AuthError, ConnectionLost, ProtocolError, SandboxerError
from .events import EventStream
from .fs import FileSystem
from .process import Process

__all__ = ["Box", "EventStream", "FileSystem", "Process", "SandboxerError", "AuthError",
           "ConnectionLost", "ProtocolError"]
__version__ = "0.1.0"
