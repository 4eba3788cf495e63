"""The agent of tests/integration/test_broker_fork.py: calls its upstream through the broker, then
forks or checkpoints itself and calls it again in every copy. One JSON line per result.

usage: fork_agent.py CFG_JSON   (cfg: mode = fork | midrequest, upstream_port, run: a tag for this box)
  fork:        a call through the broker, fork of 2, then in each of the three (original and
               copies) a call through API_BASE_URL, a DNS lookup and a CONNECT to a host that is
               not on the list; the original waits until both copies' calls reached the upstream.
  midrequest:  a call the upstream holds open (/v1/hold) is in flight in a thread while the agent
               checkpoints itself (leave_running); then the upstream lets it finish. A copy
               restored from that checkpoint (another box) finds the call closed and calls again.
A cold copy (SANDBOXER_RESUMED=1) only does what every branch does after the fork.
Standard library plus sdk/python's agent module."""
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent as channel_module  # noqa: E402

cfg = json.loads(sys.argv[1])
placeholder = os.environ.get("API_KEY", "")
base = os.environ.get("API_BASE_URL", "")


def out(check, **kw):
    print(json.dumps({"check": check, **kw}), flush=True)


def call(path, timeout=10):
    req = urllib.request.Request(base + path, headers={"x-api-key": placeholder})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:  # noqa: BLE001 - the kind of failure is the result
        return None, repr(e)


def key_matches(body):
    try:
        return json.loads(body).get("key_matches")
    except ValueError:
        return None


def connect_status(host):
    """A CONNECT through the broker (as an HTTPS client behind HTTPS_PROXY would send it)."""
    try:
        s = socket.create_connection(("127.0.0.1", int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1])), timeout=5)
        s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        line = s.recv(4096).split(b"\r\n")[0].decode(errors="replace")
        s.close()
        return line
    except OSError as e:
        return repr(e)


def lookup(name):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(name, 443, socket.AF_INET)})
    except OSError as e:
        return repr(e)


def after(me, copy):
    """What every branch does after the fork: the broker must be there, in its own namespace."""
    st, body = call(f"/v1/after?branch={me}&run={cfg['run']}")
    out("after", branch=me, copy=copy, status=st, key_matches=key_matches(body), body=body[:300],
        dns_allowed=lookup("api.example.test"), dns_denied=lookup(f"not-listed-{me}.example.org"),
        connect_denied=connect_status(f"denied-{me}.example.org"), netns=os.readlink("/proc/self/ns/net"),
        base=base)


if os.environ.get("SANDBOXER_RESUMED") == "1":
    # A cold copy (the snapshot held files only): this started again, with a fresh environment.
    after(os.environ["SANDBOXER_BRANCH"], True)
    sys.exit(0)

ch = channel_module.Channel()
st, body = call("/v1/before")
out("before", status=st, key_matches=key_matches(body), marker=os.environ.get("SBX_TEST_MARKER"))

if cfg["mode"] == "fork":
    r = ch.fork(2)
    me = r.get("branch") if r.get("copy") else "main"
    after(me, bool(r.get("copy")))
    if not r.get("copy"):
        # The box ends with its original: wait until both copies' calls reached the upstream.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            st, body = call(f"/v1/seen?run={cfg['run']}")
            if st == 200 and json.loads(body).get("after_copies", 0) >= 2:
                break
            time.sleep(0.1)
        time.sleep(1.0)  # their last lookups and refusals
    sys.exit(0)

# midrequest
held = {}


def hold():
    held["result"] = call("/v1/hold", timeout=30)


t = threading.Thread(target=hold)
t.start()
t0 = time.monotonic()
while time.monotonic() - t0 < 10:
    st, body = call("/v1/held")
    if st == 200 and json.loads(body).get("held"):
        break
    time.sleep(0.05)
out("holding", status=st, body=body)
r = ch.checkpoint("mid", leave_running=True)
copy = bool(r.get("copy"))
me = (ch.identity or {}).get("branch", "main") if copy else "main"
st, body = call("/v1/release")
t.join(30)
hst, hbody = held.get("result", (None, "no result"))
out("midrequest", branch=me, copy=copy, snapshot=r.get("snapshot"), released=st, status=hst,
    key_matches=key_matches(hbody), body=hbody[:300])
if copy:
    after(me, True)
