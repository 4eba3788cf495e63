"""Attacks on the egress broker (issue #13 item 10): allowed names that point into the host's
internal network, compression and ranges that would carry the secret past the scrub, and floods
of DNS questions.

Nothing leaves a network namespace the test makes for itself: loopback only, with the addresses
the attacks aim at (169.254.169.254, 10.1.2.3, fd00::1, 64:ff9b::a01:203) put on its `lo`, so
that when a control allows them the connection really lands, on a stand-in upstream that listens
there. The supervisor runs in that namespace with its own /etc/hosts (the names below, answered by
the system resolver the broker uses) and /etc/resolv.conf (a resolver on 127.0.0.53 that never
answers). The agent is agents/broker.py; each test asserts one attack of a box's run."""
import ctypes
import gzip
import http.client
import http.server
import json
import os
import pathlib
import secrets
import socket
import ssl
import subprocess
import threading

import pytest

from sbxtest import INIT, clean_env, close_http, make_tls, read_journal, serve_http

HERE = pathlib.Path(__file__).resolve().parent
AGENT = HERE / "agents" / "broker.py"
PLACEHOLDER = "sbx-placeholder-api-0001"

# The names an allowed wildcard covers, and where the host's resolver points them.
ADDRESSES = {"metadata": "169.254.169.254", "private": "10.1.2.3", "loopback": "127.0.0.1",
             "nat64": "64:ff9b::a01:203", "ula": "fd00::1"}
RANGES = {"metadata": "169.254.0.0/16", "private": "10.0.0.0/8", "loopback": "127.0.0.0/8",
          "nat64": "which is in 10.0.0.0/8", "ula": "fc00::/7"}
NAMES = {k: f"{k}.svc.example.test" for k in ADDRESSES}
API_ADDR = "127.0.0.9"  # the credential's upstream: the one loopback address the attacked box allows
HOSTS = "127.0.0.1 localhost\n" + "".join(f"{a} {NAMES[k]}\n" for k, a in ADDRESSES.items()) + \
    "10.1.2.3 internal.example.test\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network and mount namespaces)")
pytestmark = needs_root


class Netns:
    """A network namespace of the test's own, held by a process that sleeps in it: loopback up,
    the attacked addresses on `lo`."""

    def __init__(self):
        setup = ["ip link set lo up"]
        for a in ADDRESSES.values():
            if not a.startswith("127."):
                setup.append(f"ip addr add {a}/{128 if ':' in a else 32} dev lo")
        self.proc = subprocess.Popen(["unshare", "--net", "sh", "-c", " && ".join(setup) + " && echo ready && exec sleep 600"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError("netns setup: " + self.proc.stderr.read().decode())
        self.path = f"/proc/{self.proc.pid}/ns/net"

    def enter(self):
        """A context in which this thread's new sockets are made in the namespace."""
        return _InNetns(self.path)

    def close(self):
        self.proc.kill()
        self.proc.wait()


class _InNetns:
    CLONE_NEWNET = 0x40000000

    def __init__(self, path):
        self.path = path
        self.libc = ctypes.CDLL(None, use_errno=True)

    def _setns(self, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            if self.libc.setns(fd, self.CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns " + path)
        finally:
            os.close(fd)

    def __enter__(self):
        self.home = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        self.home_fd = os.open(self.home, os.O_RDONLY)
        self._setns(self.path)

    def __exit__(self, *exc):
        if self.libc.setns(self.home_fd, self.CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back")
        os.close(self.home_fd)


class DualStack(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class Upstream:
    """Stand-in upstreams in the namespace, each on every address of it: plain HTTP (`port`),
    and the credentials' HTTPS API (`tls_port`) whose paths echo the key they were sent: /gz-echo
    compressed when the request accepts gzip, /always-gz compressed whatever it accepts,
    /range-echo cut to a Range when asked."""

    def __init__(self, ns, tls):
        self.requests = []
        outer = self

        class Plain(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                data = f"upstream reached at {self.connection.getsockname()[0]}\n".encode()
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Api(Plain):
            def do_GET(self):
                outer.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
                key = (self.headers.get("x-api-key") or "").encode()
                status, headers, data = 200, {}, key
                if self.path == "/gz-echo" and "gzip" in (self.headers.get("accept-encoding") or ""):
                    headers["content-encoding"], data = "gzip", gzip.compress(key)
                elif self.path == "/always-gz":
                    headers["content-encoding"], data = "gzip", gzip.compress(key)
                elif self.path == "/range-echo" and (rng := self.headers.get("range", "")).startswith("bytes="):
                    a, b = (int(x) for x in rng[6:].split("-"))
                    status, data = 206, key[a:b + 1]
                    headers["content-range"] = f"bytes {a}-{a + len(data) - 1}/{len(key)}"
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        with ns.enter():
            self.plain = serve_http(DualStack(("::", 0), Plain))
            self.api = serve_http(DualStack(("::", 0), Api), tls)
        self.port = self.plain.server_address[1]
        self.tls_port = self.api.server_address[1]

    def close(self):
        for s in (self.plain, self.api):
            close_http(s)


def run_in_netns(ns, tmp, profile, agent_cfg, env, resolv="nameserver 127.0.0.53\noptions timeout:1 attempts:1\n"):
    """sandboxer-init as PID 1 of a fresh pid namespace, in `ns`, in a mount namespace where
    /etc/hosts and /etc/resolv.conf are the test's. Returns (rc, stderr, events, checks)."""
    (tmp / "hosts").write_text(HOSTS)
    (tmp / "resolv.conf").write_text(resolv)
    (tmp / "profile.json").write_text(json.dumps(profile))
    state = tmp / "state"
    cmd = ["nsenter", "--net=" + ns.path, "unshare", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c",
           'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && shift 2 && exec "$@"', "sh",
           str(tmp / "hosts"), str(tmp / "resolv.conf"), str(INIT), "--state-dir", str(state),
           "--profile", str(tmp / "profile.json"), "--", "python3", str(AGENT), json.dumps(agent_cfg)]
    r = subprocess.run(cmd, capture_output=True, timeout=120, env=clean_env("/usr/sbin:/usr/bin:/sbin:/bin", **env))
    events = read_journal(state)
    checks = {}
    for e in events:
        if e["type"] == "proc.message" and "check" in e["message"]:
            m = e["message"]
            checks[(m["check"], m.get("name"))] = m
    return {"rc": r.returncode, "stderr": r.stderr.decode(errors="replace"), "events": events, "checks": checks}


def broker_profile(tmp, ca, tls_port, allow_cidrs):
    return {"name": "broker-attacks", "network": {
        "mode": "proxy", "allow": ["*.svc.example.test", "*.slow.example.test"], "allow_cidrs": allow_cidrs,
        "resolve": {"pinned.svc.example.test": API_ADDR, "api.example.test": API_ADDR}, "timeout": "5s"},
        "credentials": [
            {"name": "api", "source": {"env": "SBX_TEST_API_SECRET"},
             "bind": {"host": "api.example.test", "port": tls_port}, "inject": {"header": "x-api-key", "format": "{}"},
             "placeholder": PLACEHOLDER, "placeholder_env": "API_KEY", "ca_file": str(ca)},
            {"name": "internal", "source": {"env": "SBX_TEST_API_SECRET"},
             "bind": {"host": "internal.example.test", "port": tls_port},
             "inject": {"header": "x-api-key", "format": "{}"}, "placeholder": "sbx-placeholder-internal",
             "ca_file": str(ca)}]}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    ns = Netns()
    tls = make_tls(tmp, ["api.example.test", "internal.example.test"])
    up = Upstream(ns, tls)
    yield {"ns": ns, "ca": tls.ca, "up": up, "secret": "sk-test-" + secrets.token_hex(16)}
    up.close()
    ns.close()


def run_addresses(lab, tmp, allow_cidrs):
    agent_cfg = {"attack": "addresses", "names": NAMES, "addresses": ADDRESSES, "port": lab["up"].port,
                 "placeholder": PLACEHOLDER}
    profile = broker_profile(tmp, lab["ca"], lab["up"].tls_port, allow_cidrs)
    return run_in_netns(lab["ns"], tmp, profile, agent_cfg, {"SBX_TEST_API_SECRET": lab["secret"]})


@pytest.fixture(scope="module")
def attacked(lab, tmp_path_factory):
    """The box as shipped: only the credential's upstream allowed, by its one address."""
    return run_addresses(lab, tmp_path_factory.mktemp("attacked"), [API_ADDR])


@pytest.fixture(scope="module")
def allowed(lab, tmp_path_factory):
    """The control: the same box with every attacked address allowed by a range."""
    return run_addresses(lab, tmp_path_factory.mktemp("allowed"),
                         [API_ADDR, "169.254.169.254/32", "10.1.2.0/24", "127.0.0.1", "64:ff9b::a01:200/120", "fd00::/8"])


def check(run, name, sub=None):
    assert (name, sub) in run["checks"], (name, sub, run["rc"], run["stderr"][-3000:])
    return run["checks"][(name, sub)]


def denials(run, **match):
    return [e for e in run["events"] if e["type"] == "policy.denied" and all(e.get(k) == v for k, v in match.items())]


def test_box_started_states_the_allowed_ranges(attacked, allowed):
    started = [e for e in attacked["events"] if e["type"] == "box.started"][0]
    assert started["network"]["allow_cidrs"] == [API_ADDR]
    assert len([e for e in allowed["events"] if e["type"] == "box.started"][0]["network"]["allow_cidrs"]) == 6


@pytest.mark.parametrize("name", list(ADDRESSES))
def test_connect_to_an_allowed_name_pointing_inside_is_refused(attacked, name):
    r = check(attacked, "connect", name)
    assert r["status"].startswith("HTTP/1.1 403"), r
    assert "upstream reached" not in r["body"] and RANGES[name] in r["body"], r
    ev = denials(attacked, what="egress", host=NAMES[name], address=ADDRESSES[name])
    assert ev and RANGES[name] in ev[0]["reason"] and "allow_cidrs" in ev[0]["reason"], ev


@pytest.mark.parametrize("name", list(ADDRESSES))
def test_connect_control_with_the_range_allowed(allowed, name):
    r = check(allowed, "connect", name)
    assert r["status"].startswith("HTTP/1.1 200"), r
    assert f"upstream reached at {ADDRESSES[name]}" in r["body"].replace("::ffff:", ""), r


@pytest.mark.parametrize("name", ["metadata", "private", "ula"])
def test_plain_http_to_an_allowed_name_pointing_inside_is_refused(attacked, allowed, name):
    r = check(attacked, "plain", name)
    assert r["status"].startswith("HTTP/1.0 403") and RANGES[name] in r["body"], r
    assert denials(attacked, what="egress", host=NAMES[name], address=ADDRESSES[name])
    # Control: allowed by range, the same request lands.
    assert "upstream reached" in check(allowed, "plain", name)["body"]


@pytest.mark.parametrize("name", list(ADDRESSES))
def test_dns_does_not_hand_out_internal_addresses(attacked, allowed, name):
    r = check(attacked, "dns", name)
    assert r["rcode"] == 5 and r["addrs"] == [], r  # REFUSED
    ev = denials(attacked, what="dns", host=NAMES[name], address=ADDRESSES[name])
    assert ev and RANGES[name] in ev[0]["reason"], ev
    # Control: allowed by range, the name is answered with its address.
    c = check(allowed, "dns", name)
    assert c["rcode"] == 0 and c["addrs"] == [ADDRESSES[name]], c


def test_credential_upstream_pointing_inside_is_refused(attacked, allowed):
    r = check(attacked, "credential_internal")
    assert r["status"] == 403 and "10.0.0.0/8" in r["body"], r
    ev = denials(attacked, what="credential", host="internal.example.test", address="10.1.2.3")
    assert ev and ev[0]["credential"] == "internal", ev
    # Control: allowed by range, the broker connects (and the stand-in there answers).
    assert check(allowed, "credential_internal")["status"] == 200


def test_compressed_echo_of_the_secret_is_scrubbed(attacked, lab):
    r = check(attacked, "gzip")
    assert r["status"] == 200 and r["encoding"] is None, r
    assert r["body"] == PLACEHOLDER, r
    sent = [q for q in lab["up"].requests if q["path"] == "/gz-echo"]
    assert sent and all(q["headers"].get("accept-encoding") == "identity" for q in sent), sent


def test_compressed_echo_control_outside_the_box(lab):
    # Control, on this host as root: what the broker would have relayed had it passed the agent's
    # Accept-Encoding on. The secret is in it, but not as bytes a scrub could find.
    raw = fetch_direct(lab, "/gz-echo", {"x-api-key": lab["secret"], "accept-encoding": "gzip"})
    assert lab["secret"].encode() not in raw
    assert gzip.decompress(raw) == lab["secret"].encode()


def test_upstream_compressing_anyway_is_refused(attacked, lab):
    r = check(attacked, "always_gzip")
    assert r["status"] == 502 and r["encoding"] is None, r
    ev = denials(attacked, what="credential", host="api.example.test", credential="api")
    assert ev and any("Content-Encoding: gzip" in e["reason"] for e in ev), ev
    raw = fetch_direct(lab, "/always-gz", {"x-api-key": lab["secret"]})
    assert gzip.decompress(raw) == lab["secret"].encode()  # control: it does carry the secret


def test_range_requests_cannot_fetch_the_secret_piecewise(attacked, lab):
    r = check(attacked, "range")
    assert r["status"] == 200 and r["body"] == PLACEHOLDER, r
    sent = [q for q in lab["up"].requests if q["path"] == "/range-echo"]
    assert sent and all("range" not in q["headers"] for q in sent), sent
    # Control, on this host: with Range passed on, 8 bytes of the secret come back, which no scrub
    # of the whole secret would match.
    assert fetch_direct(lab, "/range-echo", {"x-api-key": lab["secret"], "range": "bytes=0-7"}) == lab["secret"][:8].encode()


def fetch_direct(lab, path, headers):
    ctx = ssl.create_default_context(cafile=str(lab["ca"]))
    with lab["ns"].enter():
        sock = socket.create_connection((API_ADDR, lab["up"].tls_port), timeout=10)
    c = http.client.HTTPSConnection("api.example.test", lab["up"].tls_port, context=ctx, timeout=10)
    c.sock = ctx.wrap_socket(sock, server_hostname="api.example.test")
    c.putrequest("GET", path, skip_accept_encoding=True)
    for k, v in headers.items():
        c.putheader(k, v)
    c.endheaders()
    body = c.getresponse().read()
    c.close()
    return body


@pytest.fixture(scope="module")
def flooded(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flood")
    # A resolver that never answers, so every lookup the broker lets through stays in flight.
    with lab["ns"].enter():
        blackhole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        blackhole.bind(("127.0.0.53", 53))
    try:
        agent_cfg = {"attack": "flood", "slow_suffix": "q.slow.example.test", "below": 32, "beyond": 200,
                     "pinned": "pinned.svc.example.test", "tcp_conns": 24}
        profile = broker_profile(tmp, lab["ca"], lab["up"].tls_port, [API_ADDR])
        return run_in_netns(lab["ns"], tmp, profile, agent_cfg, {"SBX_TEST_API_SECRET": lab["secret"]})
    finally:
        blackhole.close()


def test_dns_flood_beyond_the_bound_gets_servfail(flooded):
    r = check(flooded, "beyond_bound")
    # 32 lookups of the first burst are still in flight: of these 200 at most 32 more are let
    # through, and the rest are answered SERVFAIL at once.
    assert r["rcodes"].get("2", 0) >= 200 - 64, r
    ev = denials(flooded, what="dns")
    assert any(e["reason"] == "more than 64 lookups in flight" for e in ev), ev[-5:]


def test_dns_flood_control_below_the_bound_is_let_through(flooded):
    # The same flood, smaller than the bound: every lookup waits on the resolver, none refused.
    r = check(flooded, "below_bound")
    assert r["rcodes"] == {}, r


def test_resolver_keeps_answering_after_the_flood(flooded):
    r = check(flooded, "after_flood")
    # Answered at once, not queued behind the flood (which waits on a resolver that never answers,
    # 5 s a try): the bound leaves room for a loaded machine.
    assert r["rcode"] == 0 and r["addrs"] == [API_ADDR] and r["seconds"] < 4.0, r
    assert flooded["rc"] == 0, flooded["stderr"][-2000:]


def test_dns_over_tcp_connections_are_bounded(flooded):
    r = check(flooded, "tcp_bound")
    # 16 are served; the other 8 are closed at once; after they go, a new one is answered.
    assert r["closed"] == r["opened"] - 16, r
    assert r["after"] == 0, r
