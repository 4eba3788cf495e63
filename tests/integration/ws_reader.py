"""A WebSocket client as its own process, for tests that kill a client mid-stream.

usage: ws_reader.py URL TOKEN SINCE OUTFILE
Subscribes from SINCE and appends every event line, as received, to OUTFILE (flushed each line)."""
import asyncio
import json
import pathlib
import sys

from websockets.asyncio.client import connect

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/, run as a script
from sbxtest import SUBPROTOCOL, auth_headers  # noqa: E402


async def main(url, token, since, out):
    async with connect(url, subprotocols=[SUBPROTOCOL], additional_headers=auth_headers(token), max_size=64 << 20) as ws:
        await ws.send(json.dumps({"id": 1, "op": "subscribe", "since": since}))
        with open(out, "a", buffering=1) as f:
            async for m in ws:
                if '"seq"' in m[:8]:
                    f.write(m + "\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
