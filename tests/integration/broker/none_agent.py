"""A `network: none` agent that forks itself once (test_broker_fork.py): every branch, the original
and its copy, reports its interfaces and whether it can reach a port on the host's loopback.
A cold copy (SANDBOXER_RESUMED=1: the snapshot held files only) runs this from the start again
and reports without forking. Standard library plus sdk/python's agent module."""
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent as channel_module  # noqa: E402

host_port = int(sys.argv[1])
copy, branch = True, os.environ.get("SANDBOXER_BRANCH")
if os.environ.get("SANDBOXER_RESUMED") != "1":
    r = channel_module.Channel().fork(1)
    copy = bool(r.get("copy"))
    branch = r.get("branch") if copy else "main"
ifaces = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev") if ":" in line and "|" not in line)
try:
    socket.create_connection(("127.0.0.1", host_port), timeout=2).close()
    reach = "connected"
except OSError as e:
    reach = type(e).__name__
print(json.dumps({"check": "none", "branch": branch, "copy": copy, "ifaces": ifaces, "reach": reach,
                  "resumed": os.environ.get("SANDBOXER_RESUMED")}), flush=True)
if not copy:
    time.sleep(2.5)  # the box ends with its original: let the copy report
