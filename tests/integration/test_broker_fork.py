"""The broker across checkpoint, fork and restore, with the real criu of this host (root needed).

A copy of a `network: proxy` agent comes back in a network namespace of its own, where nothing of
the original's broker is (its sockets belong to the supervisor, not to the dumped tree): each copy
gets a broker of its own at the same address and port, with the same allowlist and credentials.
The agent is broker/fork_agent.py; the upstream is a local HTTPS stand-in that can hold a call
open, so a checkpoint can be taken while the call is in flight."""
import http.server
import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from sbxtest import INIT, ROOT, close_http, make_tls, read_journal, serve_http
from test_broker import write_profile

HERE = pathlib.Path(__file__).resolve().parent
AGENT = HERE / "broker" / "fork_agent.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"

needs_criu = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")


class HoldingUpstream:
    """An HTTPS server on 127.0.0.1 that records each call and can hold /v1/hold open until
    /v1/release."""

    def __init__(self, secret, tls):
        self.requests = []
        self.holding = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                key = self.headers.get("x-api-key")
                outer.requests.append({"path": self.path, "key": key})
                body = {"path": self.path, "key_matches": key == secret}
                if self.path == "/v1/held":
                    body = {"held": outer.holding.is_set()}
                elif self.path == "/v1/release":
                    outer.release.set()
                elif self.path.startswith("/v1/seen?run="):
                    run = self.path.split("=", 1)[1]
                    body = {"after_copies": len([q for q in outer.requests if q["path"].startswith("/v1/after?branch=f")
                                                 and q["path"].endswith("&run=" + run)])}
                elif self.path == "/v1/hold":
                    outer.holding.set()
                    body["released"] = outer.release.wait(30)
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = serve_http(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler), tls)
        self.port = self.server.server_address[1]

    def close(self):
        self.release.set()
        close_http(self.server)


class Setup:
    """The upstream, the profile and the supervisor's environment one module's boxes share."""

    def __init__(self, tmp):
        self.tmp = tmp
        tls = make_tls(tmp)
        self.secret = "sk-test-" + secrets.token_hex(16)
        self.marker = "sbx-marker-" + secrets.token_hex(8)
        self.file_secret = "sk-file-" + secrets.token_hex(16)
        secret_file = tmp / "file-secret"
        secret_file.write_text(self.file_secret + "\n")
        secret_file.chmod(0o600)
        self.up = HoldingUpstream(self.secret, tls)
        self.profile = write_profile(tmp / "profile.json", "proxy", self.up.port, tls.ca, secret_file)
        # The marker travels the way a secret would if it leaked: the supervisor's environment,
        # named with --env (the agent's environment is otherwise clean).
        self.env = dict(os.environ, SBX_AGENT_SDK=str(SDK), SBX_TEST_API_SECRET=self.secret,
                        SBX_TEST_MARKER=self.marker)

    def box(self, state, args, timeout=120):
        r = subprocess.run([str(INIT), "--state-dir", str(state), "--profile", str(self.profile),
                            "--env", "SBX_AGENT_SDK", "--env", "SBX_TEST_MARKER", *args],
                           capture_output=True, timeout=timeout, env=self.env, text=True)
        return r.returncode, read_journal(state), r.stderr

    def agent(self, state, mode, environ=None, run=None):
        cfg = json.dumps({"mode": mode, "upstream_port": self.up.port, "run": run or secrets.token_hex(4)})
        saved = self.env
        self.env = environ or saved
        try:
            return self.box(state, ["--", sys.executable, str(AGENT), cfg])
        finally:
            self.env = saved


def results(events, check):
    return {e["branch"]: e["message"] for e in events if e["type"] == "proc.message" and e["message"].get("check") == check}


def denied(events, **match):
    return [e for e in events if e["type"] == "policy.denied" and all(e.get(k) == v for k, v in match.items())]


def branches_after(forked):
    """The branches that reported their `after` check: main and its two copies, or the test fails
    (a loop over an empty dict would pass)."""
    after = forked["after"]
    assert len(after) == 3 and "main" in after, (sorted(after), forked["stderr"][-3000:])
    return after


def searchable_bytes(root):
    """Every byte of every file below `root`, each .zst decompressed and each tar unpacked."""
    out = []
    for f in sorted(pathlib.Path(root).rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        if f.name.endswith(".zst"):
            data = subprocess.run(["zstd", "-dc", str(f)], capture_output=True, timeout=60, check=True).stdout
        out.append(data)
    return b"\n".join(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(tmp_path_factory.mktemp("brokerfork"))
    yield s
    s.up.close()


@pytest.fixture(scope="module")
def forked(setup):
    run = secrets.token_hex(4)
    rc, events, err = setup.agent(setup.tmp / "fork", "fork", run=run)
    return {"rc": rc, "events": events, "stderr": err, "after": results(events, "after"), "run": run}


@pytest.fixture(scope="module")
def midrequest(setup):
    rc, events, err = setup.agent(setup.tmp / "mid", "midrequest")
    created = [e for e in events if e["type"] == "checkpoint.created"]
    return {"rc": rc, "events": events, "stderr": err, "created": created[0] if created else None,
            "result": results(events, "midrequest").get("main")}


@needs_criu
def test_each_copy_reaches_the_upstream_through_a_broker_of_its_own(forked, setup):
    assert forked["rc"] == 0, forked["stderr"][-3000:]
    after = branches_after(forked)
    for b, a in after.items():
        assert a["status"] == 200 and a["key_matches"] is True, a
        assert a["copy"] is (b != "main")
        assert a["base"] == "http://127.0.0.1:3128/api"  # the URL its restored memory holds
        # The upstream got the real key on the copy's call, injected by the broker.
        assert [q["key"] for q in setup.up.requests if q["path"] == f"/v1/after?branch={b}&run={forked['run']}"] == [setup.secret]
    assert len({after[b]["netns"] for b in after}) == 3  # each in a network namespace of its own


@needs_criu
def test_a_copy_resolves_allowed_names_through_its_broker(forked):
    for b, a in branches_after(forked).items():
        assert a["dns_allowed"] == ["127.0.0.1"], (b, a)
        assert "not-listed" not in str(a["dns_denied"]) and not isinstance(a["dns_denied"], list), (b, a)


@needs_criu
def test_a_copy_refuses_hosts_off_the_list_and_names_its_branch(forked):
    for b, a in branches_after(forked).items():
        assert a["connect_denied"].startswith("HTTP/1.1 403"), a
        ev = denied(forked["events"], what="egress", host=f"denied-{b}.example.org")
        assert len(ev) == 1 and ev[0]["branch"] == b, ev
        assert ev[0]["proc"] == ("main" if b == "main" else f"main@{b}")
        dns = denied(forked["events"], what="dns", host=f"not-listed-{b}.example.org")
        assert dns and all(e["branch"] == b for e in dns), dns


def test_cold_copies_get_a_broker_of_their_own(setup):
    # Without criu on PATH the snapshot holds files only: each copy is the agent started again,
    # in a network namespace of its own with a broker there, its environment edited as the
    # original's was (placeholder and base URL in, the credential's source out).
    environ = dict(setup.env, PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    rc, events, err = setup.agent(setup.tmp / "cold", "fork", environ)
    assert rc == 0, err[-3000:]
    assert [e["mode"] for e in events if e["type"] == "restore.done"] == ["cold", "cold"]
    after = results(events, "after")
    copies = sorted(b for b in after if b != "main")
    assert len(copies) == 2, (after, err[-2000:])
    for b in copies:
        a = after[b]
        assert a["status"] == 200 and a["key_matches"] is True and a["dns_allowed"] == ["127.0.0.1"], a
        assert a["connect_denied"].startswith("HTTP/1.1 403"), a
        ev = denied(events, what="egress", host=f"denied-{b}.example.org")
        assert len(ev) == 1 and ev[0]["branch"] == b and ev[0]["proc"] == f"main@{b}", ev
    assert setup.secret not in json.dumps(events)


@needs_criu
def test_a_fork_leaves_no_secret_in_the_journal(forked, setup):
    text = subprocess.run([str(INIT.parent / "sandboxer"), "log", str(setup.tmp / "fork"), "--json"],
                          capture_output=True, timeout=60).stdout.decode()
    assert setup.marker in text  # the agent printed it: the same search finds what is there
    assert setup.secret not in text and setup.file_secret not in text


@needs_criu
def test_a_checkpoint_of_an_agent_mid_request_holds_no_secret(midrequest, setup):
    assert midrequest["created"], midrequest["stderr"][-3000:]
    assert midrequest["created"]["mode"] == "live" and midrequest["created"]["leave_running"] is True
    archive = pathlib.Path(midrequest["created"]["archive"])
    unpacked = setup.tmp / "mid-unpacked"
    unpacked.mkdir(exist_ok=True)
    tar = subprocess.run(["zstd", "-dc", str(archive)], capture_output=True, timeout=60, check=True).stdout
    (unpacked / "archive.tar").write_bytes(tar)
    (unpacked / "x").mkdir(exist_ok=True)
    subprocess.run(["tar", "-xf", str(unpacked / "archive.tar"), "-C", str(unpacked / "x")], check=True, timeout=60)
    extracted = archive.with_name(archive.name.replace(".tar.zst", ".d"))
    assert extracted.is_dir()
    for where in (unpacked, extracted):
        data = searchable_bytes(where)
        # The control: the marker, planted in the agent's memory the way a leak would put the
        # secret there (the supervisor's environment), is found by the same search.
        assert setup.marker.encode() in data, where
        assert setup.secret.encode() not in data, where
        assert setup.file_secret.encode() not in data, where
    # The call was in flight at the dump: the upstream was holding it.
    holds = [q for q in setup.up.requests if q["path"] == "/v1/hold"]
    assert len(holds) == 1 and holds[0]["key"] == setup.secret


@needs_criu
def test_the_in_flight_call_completes_after_the_checkpoint(midrequest):
    r = midrequest["result"]
    assert r is not None, midrequest["stderr"][-3000:]
    assert r["copy"] is False and r["snapshot"] == midrequest["created"]["snapshot"]
    assert r["status"] == 200 and r["key_matches"] is True, r
    assert json.loads(r["body"])["released"] is True
    assert midrequest["rc"] == 0


@needs_criu
def test_restore_in_a_new_box_gets_a_broker(midrequest, setup):
    assert midrequest["created"]
    rc, events, err = setup.box(setup.tmp / "restored", ["--restore", midrequest["created"]["archive"]])
    assert rc == 0, err[-3000:]
    started = [e for e in events if e["type"] == "box.started"][0]
    assert started["network"]["mode"] == "proxy"
    a = results(events, "after").get("main")
    assert a and a["copy"] is True, (events[-10:], err[-2000:])
    assert a["status"] == 200 and a["key_matches"] is True, a
    # Its in-flight call belonged to the original: closed in the copy (criu --tcp-close).
    assert results(events, "midrequest")["main"]["status"] is None
    ev = denied(events, what="egress", host="denied-main.example.org")
    assert len(ev) == 1 and ev[0]["branch"] == "main" and ev[0]["proc"] == "main"
    assert setup.secret not in json.dumps(events)


@needs_criu
@pytest.mark.parametrize("profile_args, why", [
    (["--set", "network.proxy_port=3129"], "reaches its broker at 127.0.0.1:3128, and this box's profile puts it at port 3129"),
    (["--set", "credentials=[]", "--set", "network.mode=host"], 'ran with network "proxy", and this box\'s profile has network "host"'),
])
def test_restore_into_a_box_with_another_network_is_refused(midrequest, setup, profile_args, why):
    # The control is test_restore_in_a_new_box_gets_a_broker: the same archive, the same profile.
    assert midrequest["created"]
    state = setup.tmp / ("refused-" + secrets.token_hex(4))
    rc, events, err = setup.box(state, [*profile_args, "--restore", midrequest["created"]["archive"]])
    assert rc == 125, err[-2000:]
    failed = [e for e in events if e["type"] == "restore.failed"]
    assert failed and why in failed[0]["error"], (failed, err[-2000:])

def none_box(tmp, environ, mode="none"):
    """An agent that forks once (`network: none` unless told); a listener on the host's loopback
    to try."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        r = subprocess.run([str(INIT), "--state-dir", str(tmp / "state"), "--set", f"network.mode={mode}",
                            "--env", "SBX_AGENT_SDK", "--",
                            sys.executable, str(HERE / "broker" / "none_agent.py"), str(listener.getsockname()[1])],
                           capture_output=True, timeout=90, env=environ, text=True)
    finally:
        listener.close()
    events = read_journal(tmp / "state")
    return r, events, results(events, "none")


@needs_criu
def test_a_live_copy_of_a_network_none_branch_has_loopback_only(tmp_path):
    r, events, res = none_box(tmp_path, dict(os.environ, SBX_AGENT_SDK=str(SDK)))
    assert r.returncode == 0, r.stderr[-3000:]
    copies = [b for b in res if b != "main"]
    assert len(copies) == 1 and res[copies[0]]["copy"] is True, (res, r.stderr[-2000:])
    assert [e["mode"] for e in events if e["type"] == "restore.done"] == ["live"]
    for b, x in res.items():
        assert x["ifaces"] == ["lo"] and x["reach"] == "ConnectionRefusedError", (b, x)


@pytest.mark.parametrize("mode", ["none", "host"])
def test_a_cold_copy_of_a_network_none_branch_has_loopback_only(tmp_path, mode):
    # Without criu on PATH the snapshot holds files only and the copy is the agent started
    # again: it gets a network namespace of its own like the original's, not the host's.
    # The control (`host`): the same agent and copy reach the host's listener.
    environ = dict(os.environ, SBX_AGENT_SDK=str(SDK), PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    r, events, res = none_box(tmp_path, environ, mode)
    assert r.returncode == 0, r.stderr[-3000:]
    copies = [b for b in res if b != "main"]
    assert len(copies) == 1 and res[copies[0]]["resumed"] == "1", (res, r.stderr[-2000:])
    assert [e["mode"] for e in events if e["type"] == "restore.done"] == ["cold"]
    for b, x in res.items():
        if mode == "host":
            assert x["reach"] == "connected", (b, x)
        else:
            assert x["ifaces"] == ["lo"] and x["reach"] == "ConnectionRefusedError", (b, x)
