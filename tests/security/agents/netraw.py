"""The raw-socket attack, run as the agent: open a raw AF_INET socket (IPPROTO_TCP), which in the
supervisor's network namespace sees every TCP segment on loopback, the API's bearer token
included; and read the files given on the command line (the server's TLS key and certificate).
Prints one JSON line: the socket's outcome ("ok" or the errno's name), the effective capability
mask from /proc/self/status, and for each file "read N bytes" or the error's name.

    python3 netraw.py [FILE ...]
    python3 netraw.py --fork    # fork once through the agent channel first; every branch reports

With --fork, SBX_AGENT_SDK names sdk/python's agent module directory; a cold copy
(SANDBOXER_RESUMED=1) runs this from the start again and reports without forking.
"""
import errno
import json
import os
import socket
import sys
import time

out = {"branch": os.environ.get("SANDBOXER_BRANCH")}
forked_original = False
if sys.argv[1:2] == ["--fork"]:
    sys.argv.pop(1)
    if os.environ.get("SANDBOXER_RESUMED") != "1":
        sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
        import agent as channel_module  # noqa: E402
        r = channel_module.Channel().fork(1)
        forked_original = not r.get("copy")
        out["branch"] = "main" if forked_original else r.get("branch")
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
    s.close()
    out["raw_socket"] = "ok"
except OSError as e:
    out["raw_socket"] = errno.errorcode.get(e.errno, str(e.errno))
for line in open("/proc/self/status"):
    if line.startswith(("CapEff:", "CapBnd:")):
        k, v = line.split(":", 1)
        out[k] = v.strip()
files = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            files[path] = "read %d bytes" % len(f.read())
    except OSError as e:
        files[path] = errno.errorcode.get(e.errno, str(e.errno))
out["files"] = files
print(json.dumps(out), flush=True)
if forked_original:
    time.sleep(2.5)  # the box ends with its original: let the copy report
