"""Attacks on the egress broker, run as the agent of tests/security/test_broker_attacks.py (root in
its box, `network: proxy`): one JSON line per attempt, which the test reads from the journal.
Standard library only.

argv[1] is a JSON object: {"attack": "addresses" | "flood", ...} with the names and ports the
test set up."""
import base64
import gzip
import http.client
import json
import socket
import struct
import sys
import time

cfg = json.loads(sys.argv[1])
PROXY = ("127.0.0.1", 3128)


def out(check, **kw):
    print(json.dumps({"check": check, **kw}), flush=True)


def read_all(s):
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except OSError as e:
        got += b"\n<" + repr(e).encode() + b">"
    return got


def connect_through(host, port):
    """CONNECT host:port at the broker, then a plain request through the tunnel. Returns the
    CONNECT status line and what came back (the refusal's text, or the upstream's answer)."""
    s = socket.create_connection(PROXY, timeout=10)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    status, _, rest = head.partition(b"\r\n")
    if b" 200 " not in status:
        body = rest.partition(b"\r\n\r\n")[2] + read_all(s)
    else:
        s.sendall(b"GET /whoami HTTP/1.0\r\nHost: x\r\n\r\n")
        body = read_all(s)
    s.close()
    return status.decode(errors="replace"), body.decode(errors="replace")


def plain_get(host, port):
    """Absolute-form plain HTTP through the broker: the status line and the whole answer."""
    s = socket.create_connection(PROXY, timeout=10)
    s.sendall(f"GET http://{host}:{port}/whoami HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
    got = read_all(s)
    s.close()
    return got.split(b"\r\n")[0].decode(errors="replace"), got.decode(errors="replace")


def dns_query(name, qtype, qid=0x4242):
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack(">HH", qtype, 1)


def dns_addresses(reply, qtype):
    """The rcode and the A/AAAA records of a reply (our resolver's answers point at the question)."""
    size = 4 if qtype == 1 else 16
    ancount = struct.unpack(">H", reply[6:8])[0]
    addrs, off = [], 12
    while reply[off]:
        off += reply[off] + 1
    off += 5
    for _ in range(ancount):
        rdlen = struct.unpack(">H", reply[off + 10:off + 12])[0]
        addrs.append(socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, reply[off + 12:off + 12 + rdlen]))
        off += 12 + rdlen
    return reply[3] & 0xF, addrs


def dns_udp(name, qtype):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    for _ in range(3):  # UDP: a lost datagram is asked again
        s.sendto(dns_query(name, qtype), ("127.0.0.1", 53))
        try:
            return dns_addresses(s.recvfrom(1500)[0], qtype)
        except socket.timeout:
            continue
    return None, []


def credential_get(path, headers):
    """A request on the credential route with exactly these headers (http.client adds no
    Accept-Encoding of its own here). Returns status, Content-Encoding and the body as received."""
    c = http.client.HTTPConnection(*PROXY, timeout=10)
    c.putrequest("GET", "/api" + path, skip_accept_encoding=True)
    for k, v in headers.items():
        c.putheader(k, v)
    c.endheaders()
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, r.getheader("content-encoding"), body


def addresses():
    for name, host in cfg["names"].items():
        status, body = connect_through(host, cfg["port"])
        out("connect", name=name, host=host, status=status, body=body[-400:])
    for name, host in cfg["names"].items():
        status, body = plain_get(host, cfg["port"])
        out("plain", name=name, host=host, status=status, body=body[-400:])
    for name, host in cfg["names"].items():
        qtype = 28 if ":" in cfg["addresses"][name] else 1
        rcode, addrs = dns_udp(host, qtype)
        out("dns", name=name, host=host, rcode=rcode, addrs=addrs)
    c = http.client.HTTPConnection(*PROXY, timeout=10)
    c.request("GET", "/internal/v1/x", headers={"x-api-key": "sbx-placeholder-internal"})
    r = c.getresponse()
    out("credential_internal", status=r.status, body=r.read().decode(errors="replace"))
    c.close()

    # The secret, echoed by an upstream that compresses when the request asks for it.
    status, enc, body = credential_get("/gz-echo", {"x-api-key": cfg["placeholder"], "Accept-Encoding": "gzip"})
    plain = gzip.decompress(body) if enc == "gzip" else body
    out("gzip", status=status, encoding=enc, body=plain.decode(errors="replace"),
        raw_b64=base64.b64encode(body).decode())
    # The same, from an upstream that compresses whatever it is asked.
    status, enc, body = credential_get("/always-gz", {"x-api-key": cfg["placeholder"]})
    out("always_gzip", status=status, encoding=enc, body_b64=base64.b64encode(body).decode())
    # The secret a few bytes at a time, by Range: no piece would match the secret whole.
    status, enc, body = credential_get("/range-echo", {"x-api-key": cfg["placeholder"], "Range": "bytes=0-7"})
    out("range", status=status, body=body.decode(errors="replace"))


def flood():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    def burst(n, tag):
        """n questions for distinct allowed names whose lookups nobody answers, then the rcodes of
        the replies that came at once (within 0.5 s: a lookup that was let through takes the
        host resolver's whole timeout, a second, to fail)."""
        for i in range(n):
            s.sendto(dns_query(f"{tag}{i}.{cfg['slow_suffix']}", 1, qid=i), ("127.0.0.1", 53))
        rcodes = {}
        deadline = time.monotonic() + 0.5
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                reply = s.recvfrom(1500)[0]
            except socket.timeout:
                break
            rcodes[str(reply[3] & 0xF)] = rcodes.get(str(reply[3] & 0xF), 0) + 1
        return rcodes

    out("below_bound", sent=cfg["below"], rcodes=burst(cfg["below"], "below"))
    # Drain what the first burst left behind before the second one is sent.
    s.settimeout(0.05)
    try:
        while True:
            s.recvfrom(1500)
    except socket.timeout:
        pass
    out("beyond_bound", sent=cfg["beyond"], rcodes=burst(cfg["beyond"], "beyond"))
    # Still answering: a pinned name (no lookup needed), at once.
    t0 = time.monotonic()
    rcode, addrs = dns_udp(cfg["pinned"], 1)
    out("after_flood", rcode=rcode, addrs=addrs, seconds=time.monotonic() - t0)

    # DNS over TCP: connections past the bound are closed at once; the first ones are kept.
    conns, closed = [], 0
    for _ in range(cfg["tcp_conns"]):
        c = socket.create_connection(("127.0.0.1", 53), timeout=5)
        conns.append(c)
    time.sleep(0.5)
    for c in conns:
        c.setblocking(False)
        try:
            closed += c.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    for c in conns:
        c.close()
    time.sleep(0.3)
    c = socket.create_connection(("127.0.0.1", 53), timeout=5)
    q = dns_query(cfg["pinned"], 1)
    c.sendall(struct.pack(">H", len(q)) + q)
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + struct.unpack(">H", buf[:2])[0]:
        chunk = c.recv(4096)
        if not chunk:
            break
        buf += chunk
    c.close()
    out("tcp_bound", opened=cfg["tcp_conns"], closed=closed,
        after=dns_addresses(buf[2:], 1)[0] if len(buf) > 14 else None)


{"addresses": addresses, "flood": flood}[cfg["attack"]]()
