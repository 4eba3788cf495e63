"""A WebSocket client that reads its socket slowly, as one on a slow link does: its own process,
its own framing (a client library reads the socket as fast as it can into its own buffers).

usage: ws_slow_reader.py PORT TOKEN SLOW_SECONDS BYTES_PER_SECOND OUTFILE
Subscribes from 0 with a small receive buffer, takes BYTES_PER_SECOND from the socket for
SLOW_SECONDS, then reads as fast as it can until an output event holding END-OF-STREAM or a Close.
Writes OUTFILE as JSON: the seqs of the events in order, the Close's code and reason (null when
none came), whether the end was seen, and the bytes taken while slow."""
import base64
import json
import os
import socket
import struct
import sys
import time
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/, run as a script
from sbxtest import SUBPROTOCOL  # noqa: E402


def connect(port, token):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Set before connect: the window the client offers stays small, so the server's kernel holds
    # what the client has not taken rather than the client's.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\n"
               f"Authorization: Bearer {token}\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        b = s.recv(1)
        if not b:
            raise SystemExit("the server hung up during the handshake")
        head += b
    if not head.startswith(b"HTTP/1.1 101"):
        raise SystemExit(f"the handshake was refused: {head[:200]!r}")
    return s


def send_text(s, text):
    payload, mask = text.encode(), os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    assert len(payload) < 126
    s.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)


def frames(buf):
    """Whole frames at the start of buf: (opcode, payload) each, and what is left."""
    out = []
    while len(buf) >= 2:
        n, at = buf[1] & 0x7F, 2
        if n == 126:
            if len(buf) < 4:
                break
            n, at = struct.unpack(">H", buf[2:4])[0], 4
        elif n == 127:
            if len(buf) < 10:
                break
            n, at = struct.unpack(">Q", buf[2:10])[0], 10
        if len(buf) < at + n:
            break
        out.append((buf[0] & 0x0F, bytes(buf[at:at + n])))
        del buf[:at + n]
    return out


def main(port, token, slow_s, rate, out):
    s = connect(port, token)
    send_text(s, json.dumps({"id": 1, "op": "subscribe", "since": 0}))
    result = {"seqs": [], "close": None, "end": False, "slow_bytes": 0}
    buf = bytearray()
    step = 0.05
    slow_until = time.monotonic() + slow_s
    while True:
        slow = time.monotonic() < slow_until
        chunk = s.recv(max(1, int(rate * step)) if slow else 1 << 20)
        if not chunk:
            break
        if slow:
            result["slow_bytes"] += len(chunk)
            time.sleep(step)
        buf += chunk
        for op, payload in frames(buf):
            if op == 8:
                code = struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else None
                result["close"] = {"code": code, "reason": payload[2:].decode(errors="replace")}
                break
            if op != 1:
                continue
            ev = json.loads(payload)
            if "seq" in ev and "id" not in ev:
                result["seqs"].append(ev["seq"])
                if ev.get("type") == "proc.output" and "END-OF-STREAM" in ev.get("data", ""):
                    result["end"] = True
        if result["close"] or result["end"]:
            break
    pathlib.Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
