"""The egress broker and credential injection (profile `network` and `credentials`).

Loopback only: the stand-in upstreams listen on 127.0.0.2 of the test's own network namespace,
which is the supervisor's (the profile allows the broker that one loopback address by
`allow_cidrs`; 127.0.0.1, where `localhost` points, stays refused); the agent runs in a namespace
of its own whose only way out is the broker. One box runs the agent of broker/agent.py (every check one JSON line); each test asserts
one behaviour of that run."""
import http.server
import json
import pathlib
import secrets
import subprocess
import time

import pytest

from sbxtest import CLI, clean_env, close_http, make_tls, read_journal, run_init, serve_http

HERE = pathlib.Path(__file__).resolve().parent
AGENT = HERE / "broker" / "agent.py"
PLACEHOLDER = "sbx-placeholder-api-0001"
UPSTREAM_ADDR = "127.0.0.2"


class Upstream:
    """An HTTP(S) server on `addr` that records what it received."""

    def __init__(self, secret=None, tls=None, addr=UPSTREAM_ADDR):
        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path == "/slow":
                    # Two pieces a while apart, as a streamed LLM reply comes.
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("content-length", "13")
                    self.end_headers()
                    self.wfile.write(b"first\n")
                    self.wfile.flush()
                    time.sleep(1.5)
                    self.wfile.write(b"second\n")
                    return
                if self.path == "/echo":
                    # The key echoed back split in two pieces: the scrub must see across them.
                    key = (self.headers.get("x-api-key") or "").encode()
                    self.send_response(200)
                    self.send_header("content-length", str(len(key)))
                    self.end_headers()
                    self.wfile.write(key[:10])
                    self.wfile.flush()
                    time.sleep(0.2)
                    self.wfile.write(key[10:])
                    return
                if False:
                    data = (self.headers.get("x-api-key") or "").encode()
                else:
                    data = json.dumps({"path": self.path, "key_matches": secret is not None and
                                       self.headers.get("x-api-key") == secret,
                                       "key_present": "x-api-key" in self.headers,
                                       "authorization": self.headers.get("authorization")}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = reply

        self.server = serve_http(http.server.ThreadingHTTPServer((addr, 0), Handler), tls)
        self.port = self.server.server_address[1]

    def close(self):
        close_http(self.server)


def write_profile(path, mode, upstream_port, ca, secret_file, upstream_addr="127.0.0.1"):
    profile = {"name": "broker-test", "network": {"mode": mode}}
    if mode == "proxy":
        profile["network"].update({
            "allow": ["api.example.test", "other.example.test", "localhost"],
            "deny": ["*.evil.com"],
            "resolve": {"api.example.test": upstream_addr, "other.example.test": upstream_addr},
            # The stand-ins listen on loopback, which the broker refuses unless allowed.
            "allow_cidrs": [upstream_addr],
            "timeout": "2s", "max_header_bytes": 16384, "max_body_bytes": 1048576})
        profile["credentials"] = [{
            "name": "api", "source": {"env": "SBX_TEST_API_SECRET"},
            "bind": {"scheme": "https", "host": "api.example.test", "port": upstream_port},
            "inject": {"header": "x-api-key", "format": "{}"},
            "placeholder": PLACEHOLDER, "placeholder_env": "API_KEY", "base_url_env": "API_BASE_URL",
            "ca_file": str(ca)},
            {"name": "files", "source": {"file": str(secret_file)},
             "bind": {"host": "api.example.test", "port": upstream_port},
             "inject": {"header": "authorization", "format": "Bearer {}"}, "ca_file": str(ca)}]
    path.write_text(json.dumps(profile))
    return path


def run_agent_box(tmp, mode):
    tls = make_tls(tmp)
    ca = tls.ca
    secret = "sk-test-" + secrets.token_hex(16)
    marker = "sbx-marker-" + secrets.token_hex(8)
    up = Upstream(secret, tls)
    other = Upstream()
    state = tmp / "state"
    ws = state / "branches" / "main" / "workspace"
    ws.mkdir(parents=True)
    (ws / "ca.pem").write_text(ca.read_text())
    (ws / "agent.py").write_text(AGENT.read_text())
    # A second credential read from a file the agent could otherwise see (under the host's /tmp).
    file_secret = "sk-file-" + secrets.token_hex(16)
    secret_file = tmp / "file-secret"
    secret_file.write_text(file_secret + "\n")
    secret_file.chmod(0o600)
    profile = write_profile(tmp / "profile.json", mode, up.port, ca, secret_file, UPSTREAM_ADDR)
    cfg = {"mode": mode, "upstream_addr": UPSTREAM_ADDR, "upstream_port": up.port, "other_port": other.port,
           "proxy_port": 3128,
           "tmp": str(tmp), "secret_file": str(secret_file)}
    env = clean_env(SBX_TEST_API_SECRET=secret, SBX_TEST_MARKER=marker)
    try:
        # The marker is named with --env (the agent's environment is otherwise clean); the secret,
        # in the same environment, is the broker's alone.
        r = run_init(["--profile", str(profile), "--env", "SBX_TEST_MARKER", "--", "python3", "/workspace/agent.py",
                      json.dumps(cfg)], state,
                     timeout=90, env=env)
    finally:
        up.close()
        other.close()
    events = read_journal(state)
    results = {}
    for e in events:
        if e["type"] == "proc.message" and "check" in e["message"]:
            results.setdefault(e["message"]["check"], []).append(e["message"])
    return {"rc": r.returncode, "stderr": r.stderr.decode(errors="replace"), "events": events, "results": results,
            "secret": secret, "file_secret": file_secret, "marker": marker, "upstream": up, "state": state, "seen": (ws / "seen.txt").read_text()}


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    return run_agent_box(tmp_path_factory.mktemp("proxied"), "proxy")


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    return run_agent_box(tmp_path_factory.mktemp("control"), "host")


def check(run, name):
    assert name in run["results"], (name, run["stderr"][-2000:], [e for e in run["events"] if e["type"] == "proc.output"][-20:])
    return run["results"][name][0]


def denied(run, **match):
    return [e for e in run["events"] if e["type"] == "policy.denied" and all(e.get(k) == v for k, v in match.items())]


def agent_pid(run):
    return [e for e in run["events"] if e["type"] == "proc.started"][0]["pid"]


def all_journal_text(state):
    """The journal as users read it, plus every segment file decompressed."""
    text = subprocess.run([str(CLI), "log", str(state), "--json"], capture_output=True, timeout=60).stdout
    for f in (state / "journal").rglob("*"):
        if f.is_file():
            raw = f.read_bytes()
            if f.suffix == ".zst":
                raw = subprocess.run(["zstd", "-dc", str(f)], capture_output=True, timeout=60).stdout
            text += raw
    return text.decode(errors="replace")


def test_box_started_names_the_network_policy(proxied, control):
    started = [e for e in proxied["events"] if e["type"] == "box.started"][0]
    assert started["network"]["mode"] == "proxy" and started["network"]["isolated"] is True
    assert started["network"]["credentials"][0]["name"] == "api"
    host = [e for e in control["events"] if e["type"] == "box.started"][0]
    assert host["network"] == {"mode": "host", "isolated": False}


def test_upstream_receives_the_injected_key(proxied):
    r = check(proxied, "credential")
    assert r["status"] == 200, r
    body = json.loads(r["body"])
    assert body["key_matches"] is True
    assert body["path"] == "/v1/messages?beta=1"
    # The caller's own Authorization header was stripped, not forwarded.
    assert body["authorization"] is None
    assert proxied["upstream"].requests[0]["headers"]["x-api-key"] == proxied["secret"]


def test_agent_sees_only_the_placeholder(proxied):
    env = check(proxied, "env")
    assert env["placeholder"] == PLACEHOLDER
    assert env["base"] == "http://127.0.0.1:3128/api"
    # The search finds the marker planted the same way as the secret (the supervisor's env)...
    assert proxied["marker"] in proxied["seen"]
    # ...and never the secret: not in its env, /proc it can read, or its files.
    assert proxied["secret"] not in proxied["seen"]


def test_credential_file_is_hidden_from_the_agent(proxied, control):
    # The file lies under the host's /tmp, which the agent sees through an overlay: masked.
    r = check(proxied, "secret_file")
    assert not r.get("readable") or r["length"] == 0, r
    assert proxied["file_secret"] not in proxied["seen"]
    # Control: without a credential naming it, the same file is there to read.
    assert check(control, "secret_file")["readable"] is True


def test_secret_is_not_in_the_journal_or_logs(proxied):
    text = all_journal_text(proxied["state"])
    assert proxied["marker"] in text
    assert proxied["secret"] not in text
    assert proxied["secret"] not in proxied["stderr"]
    assert proxied["file_secret"] not in text


def test_a_streamed_reply_reaches_the_agent_as_it_comes(proxied):
    r = check(proxied, "stream")
    assert r["first"] == "first\n" and r["rest"] == "second\n", r
    assert r["first_after"] < 1.0 and r["total"] >= 1.4, r


def test_upstream_echo_of_the_secret_is_scrubbed(proxied):
    r = check(proxied, "echo")
    assert r["status"] == 200 and r["body"] == PLACEHOLDER


def test_placeholder_toward_another_allowed_host_is_refused(proxied):
    r = check(proxied, "wrong_destination")
    assert r["status"] == 403, r
    ev = denied(proxied, what="credential", host="other.example.test")
    assert ev and ev[0]["proc"] == "main" and ev[0]["credential"] == "api"
    # The process that sent it, found by the socket it held in its namespace.
    assert ev[0]["pid"] == agent_pid(proxied)
    # The same host without the placeholder is reachable: the refusal is about the credential.
    assert check(proxied, "plain_allowed")["status"] == 200


def test_placeholder_control_without_the_policy(control):
    # Without the broker nothing inspects the request: the same call goes through.
    assert check(control, "wrong_destination")["status"] == 200


def test_paths_leaving_the_binding_prefix_are_refused(proxied):
    statuses = check(proxied, "traversal")["statuses"]
    assert all(st.startswith("HTTP/1.1 403") for st in statuses), statuses
    assert denied(proxied, what="credential", reason="path leaves the binding's prefix")
    assert not [q for q in proxied["upstream"].requests if "admin" in q["path"]]
    # The same endpoint with a plain path is forwarded (test_upstream_receives_the_injected_key).


def test_connect_tunnel_to_an_allowed_host(proxied):
    r = check(proxied, "connect_allowed")
    assert r["status"] == 200, r
    # A tunnel is not the credential path: nothing is injected into it.
    assert json.loads(r["body"])["key_present"] is False


def test_connect_to_a_host_not_on_the_list_is_refused(proxied):
    r = check(proxied, "connect_denied")
    assert r["status"] is None and "403" in r["body"], r
    assert denied(proxied, what="egress", host="denied.example.org")


def test_listed_name_resolving_to_loopback_is_refused(proxied):
    # localhost is listed but resolves (through the system resolver) to the supervisor's own
    # loopback, 127.0.0.1, which allow_cidrs does not hold; api.example.test, pinned to the
    # allowed 127.0.0.2 by `resolve`, was reached above.
    assert check(proxied, "connect_local")["status"].startswith("HTTP/1.1 403")
    ev = denied(proxied, what="egress", host="localhost")
    assert ev and "loopback" in ev[0]["reason"] and ev[0]["address"] == "127.0.0.1", ev
    assert check(proxied, "connect_allowed")["status"] == 200


def test_raw_connections_fail_fast(proxied):
    raws = proxied["results"]["raw"]
    assert len(raws) == 4
    for r in raws:
        assert r["result"] != "connected", r
        assert r["seconds"] < 1.0, r


def test_raw_connection_control_without_the_policy(control):
    assert check(control, "raw")["result"] == "connected"


def test_dns_answers_allowed_names_only(proxied):
    assert check(proxied, "dns_allowed")["addr"] == UPSTREAM_ADDR
    assert check(proxied, "dns_allowed_raw")["rcode"] == 0
    assert check(proxied, "dns_denied")["addr"] is None
    assert denied(proxied, what="dns", host="not-listed.example.org")


def test_dns_over_tcp_answers_allowed_names_only(proxied):
    # Two queries on one connection: the allowed name is answered, the other refused and reported.
    r = check(proxied, "dns_tcp")
    assert r.get("rcode") == 0 and r["addr"] == UPSTREAM_ADDR, r
    assert r["denied_rcode"] == 5
    ev = denied(proxied, what="dns", host=r["denied_name"])
    assert ev and ev[0]["pid"] == agent_pid(proxied)


def test_resolver_survives_garbage_datagrams(proxied):
    assert check(proxied, "dns_after_garbage")["rcode"] == 0


def test_dns_label_exfiltration_is_refused_and_reported(proxied):
    r = check(proxied, "dns_exfil")
    assert r["rcode"] == 5  # REFUSED
    ev = denied(proxied, what="dns", host=r["name"])
    assert ev and "evil.com" in ev[0]["reason"] and ev[0]["proc"] == "main"
    assert ev[0]["pid"] == agent_pid(proxied)


def test_a_flood_of_refusals_is_reported_bounded(proxied):
    flood = [e for e in denied(proxied, what="dns") if e["host"].startswith("flood")]
    assert 0 < len(flood) <= 50
    later = denied(proxied, what="dns", host="after-flood.example.org")
    assert later and later[0]["suppressed_before"] >= 150 - 50


def test_broker_survives_malformed_oversized_and_slow_clients(proxied):
    assert check(proxied, "malformed")["status"].startswith("HTTP/1.1 400"), check(proxied, "malformed")
    assert check(proxied, "oversized")["status"].startswith("HTTP/1.1 431")
    assert check(proxied, "huge_body")["status"].startswith("HTTP/1.1 413")
    assert check(proxied, "during_slow")["status"] == 200
    slow = check(proxied, "slow")
    assert slow["closed"] and slow["seconds"] < 6, slow
    assert check(proxied, "after_abuse")["status"] == 200
    assert proxied["rc"] == 0, proxied["stderr"][-2000:]


def test_network_none_has_only_loopback(tmp_path):
    state = tmp_path / "state"
    r = run_init(["--set", "network.mode=none", "--", "sh", "-c", "cat /proc/net/dev; cat /etc/resolv.conf"], state,
                 timeout=30)
    assert r.returncode == 0, r.stderr
    text = "".join(e.get("data", "") for e in read_journal(state) if e["type"] == "proc.output")
    ifaces = [line.split(":")[0].strip() for line in text.splitlines() if ":" in line and "|" not in line
              and "nameserver" not in line]
    assert ifaces == ["lo"], text


def test_network_none_fails_lookups_and_connections_fast(tmp_path):
    state = tmp_path / "state"
    script = ("import socket, time\n"
              "t = time.monotonic()\n"
              "for target in (('example.com', 80), ('10.0.0.1', 80)):\n"
              "    try:\n"
              "        socket.create_connection(target, timeout=5)\n"
              "        print('connected')\n"
              "    except OSError as e:\n"
              "        print('refused', type(e).__name__)\n"
              "print('took', time.monotonic() - t)\n")
    r = run_init(["--set", "network.mode=none", "--", "python3", "-c", script], state, timeout=30)
    assert r.returncode == 0, r.stderr
    text = "".join(e.get("data", "") for e in read_journal(state) if e["type"] == "proc.output")
    assert text.count("refused") == 2 and "connected" not in text, text
    assert float(text.split("took")[1]) < 2.0, text


def test_network_host_control_sees_the_hosts_interfaces(tmp_path):
    state = tmp_path / "state"
    r = run_init(["--", "cat", "/proc/net/dev"], state, timeout=30)
    assert r.returncode == 0
    mine = {line.split(":")[0].strip() for line in open("/proc/net/dev") if ":" in line and "|" not in line}
    text = "".join(e.get("data", "") for e in read_journal(state) if e["type"] == "proc.output")
    theirs = {line.split(":")[0].strip() for line in text.splitlines() if ":" in line and "|" not in line}
    assert theirs == mine


def test_network_policy_without_namespaces_is_refused(tmp_path):
    r = run_init(["--set", "network.mode=proxy", "--set", "isolation.namespaces=false", "--", "true"],
                 tmp_path / "state", timeout=30)
    assert r.returncode == 125
    assert b"needs the agent in namespaces of its own" in r.stderr


def test_sandboxer_log_shows_refusals_for_a_person(proxied):
    out = subprocess.run([str(CLI), "log", str(proxied["state"])], capture_output=True, timeout=60).stdout.decode()
    assert "network proxy)" in out
    assert "main denied dns not-listed.example.org (not on the allow list" in out
    assert "main denied credential other.example.test:" in out
