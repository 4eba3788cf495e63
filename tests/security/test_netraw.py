"""CAP_NET_RAW beside the API (issue #13, item 2).

With `network: host` the agent shares the supervisor's network namespace, where the API's bearer
token crosses loopback in clear (ws://127.0.0.1). Before, the default profile kept CAP_NET_RAW
there, and a raw AF_INET/IPPROTO_TCP socket sees every TCP segment on loopback. Now the agent
never keeps CAP_NET_RAW when it shares that namespace, whatever the profile lists; and the
server's --tls-cert/--tls-key files are masked from it like the token file."""
import json
import os
import pathlib
import secrets
import subprocess
import sys

import pytest

from sbxtest import make_tls, of_type, read_journal, run_init, started

pytestmark = pytest.mark.timeout(90)

AGENT = pathlib.Path(__file__).resolve().parent / "agents" / "netraw.py"
CAP_NET_RAW = 13


def report(state_dir, args, files=()):
    r = run_init([*args, "--", "python3", str(AGENT), *map(str, files)], state_dir)
    ev = read_journal(state_dir)
    msgs = [e["message"] for e in of_type(ev, "proc.message") if "raw_socket" in e["message"]]
    assert msgs, (r.returncode, r.stderr.decode(errors="replace")[-2000:])
    return msgs[0], ev


def has_cap(mask_hex, cap):
    return bool(int(mask_hex, 16) & (1 << cap))


@pytest.mark.parametrize("caps", ["profile", "all"], ids=["default-profile", "capabilities-null"])
def test_a_raw_socket_beside_the_api_is_refused(state_dir, caps):
    # The default profile lists CAP_NET_RAW; `null` keeps every capability the supervisor has.
    sets = [] if caps == "profile" else ["--set", "isolation.capabilities=null"]
    rep, ev = report(state_dir, sets)
    assert rep["raw_socket"] == "EPERM", rep
    assert not has_cap(rep["CapEff"], CAP_NET_RAW) and not has_cap(rep["CapBnd"], CAP_NET_RAW), rep
    enf = started(ev)["enforcement"]
    assert "less CAP_NET_RAW" in enf["capabilities"] and enf["network"].startswith("host"), enf


def test_control_in_a_network_namespace_of_its_own_the_raw_socket_works(state_dir):
    # network none: the agent's own namespace, loopback only, nothing of the API's to see. The
    # profile's CAP_NET_RAW is kept there, and the same socket opens.
    rep, ev = report(state_dir, ["--set", "network=none"])
    assert rep["raw_socket"] == "ok", rep
    assert has_cap(rep["CapEff"], CAP_NET_RAW), rep
    assert "CAP_NET_RAW" not in started(ev)["enforcement"]["capabilities"]


def test_control_outside_the_box_the_raw_socket_works():
    # The probe detects success: the same program as root on this host, in its namespace.
    if os.geteuid() != 0:
        pytest.skip("needs root")
    out = subprocess.run([sys.executable, str(AGENT)], capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout)["raw_socket"] == "ok", out


def test_a_cold_copy_beside_the_api_has_no_raw_socket_either(state_dir):
    # Without criu on PATH the snapshot holds files only and the copy is the agent started again,
    # in the host's network namespace like the original: it goes through the same policy.
    sdk = pathlib.Path(__file__).resolve().parents[2] / "sdk" / "python" / "sandboxer"
    path = ":".join(d for d in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(d, "criu")))
    r = run_init(["--env", f"SBX_AGENT_SDK={sdk}", "--", "python3", str(AGENT), "--fork"], state_dir,
                 env=dict(os.environ, PATH=path), timeout=90)
    ev = read_journal(state_dir)
    reps = {e["message"]["branch"]: e["message"] for e in of_type(ev, "proc.message") if "raw_socket" in e["message"]}
    assert [e["mode"] for e in of_type(ev, "restore.done")] == ["cold"], r.stderr.decode(errors="replace")[-2000:]
    assert len(reps) == 2, reps
    for b, rep in reps.items():
        assert rep["raw_socket"] == "EPERM" and not has_cap(rep["CapBnd"], CAP_NET_RAW), (b, rep)


def make_cert(d):
    tls = make_tls(d, ["127.0.0.1"])
    return tls.cert, tls.key


def test_the_tls_key_and_certificate_are_masked(tmp_path):
    cert, key = make_cert(tmp_path)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16) + "\n")
    rep, ev = report(tmp_path / "s", ["--listen", "127.0.0.1:0", "--token-file", str(token),
                                      "--tls-cert", str(cert), "--tls-key", str(key)], [cert, key, token])
    assert of_type(ev, "server.listening")[0]["tls"] is True
    for f in (cert, key, token):
        assert rep["files"][str(f)] in ("read 0 bytes", "EACCES", "ENOENT"), rep["files"]


@pytest.mark.parametrize("through_link", ["token", "state", "both"])
def test_masked_files_reached_through_a_symlink_stay_masked_and_the_box_keeps_its_namespaces(tmp_path, through_link):
    # The token file and the state dir named through a symlinked directory (as a HOME or a
    # state dir that is one): the masks were mounted where the host's root resolves the link,
    # outside the branch's view, so the agent read the token at its real path; and the state
    # dir's mask covered the new root itself (pivot_root: ENOENT), so the box ran without
    # namespaces. A file beside them is the control: the agent reads that directory.
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    token, beside = real / "token", real / "beside"
    token.write_text(secrets.token_hex(16) + "\n")
    beside.write_text("beside\n")
    state = (link if through_link in ("state", "both") else real) / "s"
    token_arg = (link if through_link in ("token", "both") else real) / "token"
    rep, ev = report(state, ["--listen", "127.0.0.1:0", "--token-file", str(token_arg)],
                     [token, link / "token", real / "s" / "box.json", beside])
    assert started(ev)["capabilities"]["namespaces"] is True, started(ev)["capabilities"]
    for f in (token, link / "token", real / "s" / "box.json"):
        assert rep["files"][str(f)] in ("read 0 bytes", "EACCES", "ENOENT"), rep["files"]
    assert rep["files"][str(beside)] == "read 7 bytes", rep["files"]


def test_control_the_same_files_are_readable_when_not_the_servers(tmp_path):
    cert, key = make_cert(tmp_path)
    rep, _ = report(tmp_path / "s", [], [cert, key])
    for f in (cert, key):
        assert rep["files"][str(f)].startswith("read ") and rep["files"][str(f)] != "read 0 bytes", rep["files"]
