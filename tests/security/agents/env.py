"""The environment attack, run as the agent: look for the operator's secrets in what the agent
was started with. Prints one JSON line: its whole os.environ, and which of the names given on the
command line (NAME or NAME=VALUE) appear in os.environ and, byte for byte, in /proc/self/environ
(the block the kernel keeps, which unsetenv in the process cannot clean).

    python3 env.py NAME[=VALUE] ...
"""
import json
import os
import sys

raw = open("/proc/self/environ", "rb").read()
found = {}
for arg in sys.argv[1:]:
    name, _, value = arg.partition("=")
    found[name] = {
        "in_environ": name in os.environ,
        "value": os.environ.get(name),
        "in_proc_environ": (name + "=").encode() in raw and (not value or value.encode() in raw),
    }
print(json.dumps({"environ": dict(os.environ), "found": found}), flush=True)
