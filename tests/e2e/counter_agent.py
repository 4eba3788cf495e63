# A long-running agent for live checkpoint tests in a container: a nonce made at start and kept
# only in memory, and a counter, printed as one JSON line per tick with the branch and index it runs as
# (read from /run/sandboxer/branch.json, which each restored copy gets its own of). A cold
# restart would print a new nonce and count from 1 again; a live copy goes on from the counter
# the checkpoint froze, with the same nonce.
import json
import os
import socket
import sys
import time

# usage: counter_agent.py [HEAP_MB]: also hold HEAP_MB of heap from os.urandom (benchmarks).
heap = bytearray(os.urandom(int(sys.argv[1]) << 20)) if len(sys.argv) > 1 else b""
nonce = os.urandom(16).hex()
# A TCP listener, as agents hold sockets: each copy restores it in a network namespace of its own.
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", 0))  # any port: boxes share the host network
listener.listen()


def identity():
    try:
        with open("/run/sandboxer/branch.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


n = 0
while True:
    n += 1
    me = identity()
    print(json.dumps({"n": n, "nonce": nonce, "branch": me.get("branch"), "index": me.get("index")}), flush=True)
    time.sleep(0.1)
