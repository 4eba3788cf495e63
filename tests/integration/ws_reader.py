"""A WebSocket client as its own process, for tests that kill a client mid-stream.

usage: ws_reader.py URL TOKEN SINCE OUTFILE [CLOSEFILE]
Subscribes from SINCE and appends every event line, as received, to OUTFILE (flushed each line).
With CLOSEFILE, writes there how the connection ended: {"code", "reason"} of the server's Close
frame, or {"code": null} when it ended without one."""
import asyncio
import json
import pathlib
import sys

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/, run as a script
from sbxtest import SUBPROTOCOL, auth_headers  # noqa: E402


async def main(url, token, since, out, closefile=None):
    async with connect(url, subprotocols=[SUBPROTOCOL], additional_headers=auth_headers(token), max_size=64 << 20) as ws:
        await ws.send(json.dumps({"id": 1, "op": "subscribe", "since": since}))
        with open(out, "a", buffering=1) as f:
            try:
                while True:
                    m = await ws.recv()
                    if '"seq"' in m[:8]:
                        f.write(m + "\n")
            except ConnectionClosed as e:
                if closefile:
                    rcvd = e.rcvd
                    ended = {"code": rcvd.code, "reason": rcvd.reason} if rcvd else {"code": None}
                    pathlib.Path(closefile).write_text(json.dumps(ended))
                    return
                if not isinstance(e, ConnectionClosedOK):
                    raise


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6]))
