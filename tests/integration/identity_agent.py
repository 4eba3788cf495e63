"""The agent of tests/integration/test_fork_correctness.py: what a copy must not share with its
parent or its siblings, read from inside the copy.

usage: identity_agent.py PORT

It prints JSON lines: `before` (the parent's facts just before the fork), then in the parent and
in each copy `after` (the same facts read again after the fork, and what the channel let it do).
"""
import json
import os
import random
import socket
import sys
import time

sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
from net_probes import bindable, tcp_state  # noqa: E402  (beside this script)
import agent as channel_module  # noqa: E402  (sdk/python/sandboxer/agent.py, stdlib only)

port = int(sys.argv[1])
ws = os.environ["SANDBOXER_WORKSPACE"]
hooks = []


@channel_module.on_restore
def reopen(identity):
    hooks.append(identity.get("branch"))


def say(**kw):
    print(json.dumps(kw), flush=True)


def ns(name):
    return os.readlink(f"/proc/self/ns/{name}")


def facts():
    return {
        "machine_id": open("/etc/machine-id").read().strip(),
        "hostname": socket.gethostname(),
        "getrandom": os.getrandom(16).hex(),
        "random": random.random(),  # the module's generator: reseeded in a copy by on_restore
        "own_rng": own_rng.random(),  # a generator of the agent's own, not reseeded: the control
        "pidns": ns("pid"),
        "netns": ns("net"),
        "utsns": ns("uts"),
    }


random.seed(1234)
own_rng = random.Random(99)
ch = channel_module.Channel()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen()
# A live TCP connection of the parent's across the fork: only the parent may keep it.
conn_c = socket.create_connection(("127.0.0.1", port), timeout=5)
conn_s, _ = listener.accept()
say(before=facts())

r = ch.fork(2, name="explore")
me = r.get("branch") if r.get("copy") else "main"
after = facts()
tcp = tcp_state(conn_c, conn_s)
# The parent's port is free to bind again in a copy only if the copy has a network of its own
# (its restored listener holds it otherwise); a fresh port the same in every copy.
bound = bindable(port + 1)

# What the channel lets a copy do to what is not its own.
refusals = {}
mine = None
if r.get("copy"):
    try:
        ch.delete_snapshot(r["snapshot"])  # its parent's: it may fork from it, not delete it
        refusals["delete_parent_snapshot"] = "allowed"
    except channel_module.ChannelError as e:
        refusals["delete_parent_snapshot"] = e.code
    if r.get("index") == 1:
        mine = ch.checkpoint(f"mine-{me}")["snapshot"]
    time.sleep(1.5)  # the sibling's checkpoint is taken by now
    listed = [s["id"] for s in ch.snapshots()]
else:
    time.sleep(1.5)
    listed = [s["id"] for s in ch.snapshots()]
say(after=after, branch=me, copy=bool(r.get("copy")), index=r.get("index"), hooks=hooks, tcp=tcp,
    bound=bound, refusals=refusals, mine=mine, listed=listed)
time.sleep(0.5)
