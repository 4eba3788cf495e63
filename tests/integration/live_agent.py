"""The agent the checkpoint tests run (inside a branch, started by sandboxer-init).

usage: live_agent.py MODE PORT HEAP_MB [LINGER_S]
  MODE: restore (checkpoint and end), keep (checkpoint and go on), fork (fork 4 copies)

It holds what a cold restart cannot fake: HEAP_MB of heap from os.urandom, a nonce that is never
written to disk, a counter, a TCP listener and an open file. It prints JSON lines: one at the
start (nonce, heap checksum), one per tick, and one after the checkpoint in every copy that runs.
"""
import hashlib
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
from net_probes import bindable, tcp_state  # noqa: E402  (beside this script)
import agent as channel_module  # noqa: E402  (sdk/python/sandboxer/agent.py, stdlib only)

mode, port, heap_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
linger = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
ws = os.environ["SANDBOXER_WORKSPACE"]


def say(**kw):
    print(json.dumps(kw), flush=True)


if os.environ.get("SANDBOXER_RESUMED") == "1":
    # A cold restart on the snapshot's files: memory is new; the files are the snapshot's.
    say(resumed=True, snapshot=os.environ.get("SANDBOXER_SNAPSHOT"), branch=os.environ.get("SANDBOXER_BRANCH"),
        before=open(os.path.join(ws, "before.txt")).read())
    sys.exit(0)

heap = bytearray(os.urandom(heap_mb << 20))
heap_sum = hashlib.sha256(heap).hexdigest()
nonce = os.urandom(16).hex()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen()
log = open(os.path.join(ws, "counter.log"), "a")
ch = channel_module.Channel()
say(start=True, nonce=nonce, sum=heap_sum)

n = 0
while n < 3:
    n += 1
    log.write(f"{n}\n")
    log.flush()
    say(n=n)
    time.sleep(0.02)
# A live TCP connection across the checkpoint (like an agent's open API call): the original
# keeps it; the copies get it closed (criu --tcp-close), as only one of them can own it.
conn_c = socket.create_connection(("127.0.0.1", port), timeout=5)
conn_s, _ = listener.accept()
with open(os.path.join(ws, "before.txt"), "w") as f:
    f.write(nonce)  # the file written just before the checkpoint (the nonce stays in memory)

if mode == "nested":
    # A pid namespace nested in the tree: criu cannot dump it. The refusal comes back with the
    # reason and this agent goes on.
    import subprocess
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    time.sleep(0.3)
    try:
        ch.checkpoint("nested")
        say(refused=False)
    except channel_module.ChannelError as e:
        say(refused=True, code=e.code, message=e.message)
    inner.kill()
    inner.wait()
    say(still_running=True)
    sys.exit(0)
if mode == "fork":
    r = ch.fork(4)
else:
    r = ch.checkpoint("mid", leave_running=(mode == "keep"))

me = (ch.identity or {}).get("branch", os.environ.get("SANDBOXER_BRANCH"))
tcp = tcp_state(conn_c, conn_s)
# The listener still works: connect to it and get the bytes through.
c = socket.create_connection(("127.0.0.1", port), timeout=5)
s, _ = listener.accept()
c.sendall(b"ping")
got = s.recv(4).decode()
# The same fresh port in every copy: each has its own network namespace.
bound = bindable(port + 1)
with open(os.path.join(ws, f"mine-{me}.txt"), "w") as f:
    f.write(me)
others = sorted(x for x in os.listdir(ws) if x.startswith("mine-") and x != f"mine-{me}.txt")
n += 1
log.write(f"{n}\n")
log.flush()
try:
    identity_file = channel_module.branch_info()
except OSError:
    identity_file = None
say(after=True, copy=r.get("copy"), tcp=tcp, hostname=socket.gethostname(),
    clocks=os.readlink("/proc/self/ns/time"), netns=os.readlink("/proc/self/ns/net"), snapshot=r.get("snapshot"), branch=me, n=n, nonce=nonce,
    sum=hashlib.sha256(heap).hexdigest(), ping=got, bound=bound, others=others,
    before=open(os.path.join(ws, "before.txt")).read(), counter=open(os.path.join(ws, "counter.log")).read().split(),
    branch_json=identity_file)
time.sleep(linger)
