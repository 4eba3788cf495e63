"""The agent's isolation policy: seccomp, Landlock, no_new_privs, masks, capabilities, and strict
profiles. Every refusal has a control run showing the same action succeeds without the policy."""
import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from sbxtest import INIT, PROBE, box, exited, output, probe, read_journal, run_init, started

pytestmark = pytest.mark.timeout(60)

EPERM, ENOSYS = 1, 38


def syscall_results(ev):
    res = {}
    for line in output(ev).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and not parts[0].endswith(":"):
            res[parts[0]] = int(parts[1])
    return res


def test_seccomp_refuses_every_listed_syscall(state_dir):
    # All capabilities kept, so an EPERM can only come from the filter (in a network namespace of
    # its own: beside the supervisor's, CAP_NET_RAW, which AF_PACKET needs, is always dropped).
    r, ev = box(state_dir, probe("syscalls"), 'isolation.capabilities=["ALL"]', "network=none")
    res = syscall_results(ev)
    assert len(res) >= 45, output(ev)
    wrong = {k: v for k, v in res.items() if k not in ("clone3", "fork") and v != EPERM}
    assert not wrong, wrong
    assert res["clone3"] == ENOSYS
    assert res["fork"] == 0  # plain clone is allowed
    assert "Seccomp:\t2" in output(ev)
    assert started(ev)["enforcement"]["seccomp"] == "default"


def test_seccomp_control_without_the_filter(state_dir):
    r, ev = box(state_dir, probe("syscalls"), 'isolation.capabilities=["ALL"]', "isolation.seccomp=none", "network=none")
    res = syscall_results(ev)
    assert len(res) >= 45, output(ev)
    eperm = {k: v for k, v in res.items() if v == EPERM}
    assert not eperm, eperm
    assert res["clone3"] != ENOSYS
    assert "Seccomp:\t0" in output(ev)


def test_landlock_refuses_writes_outside_its_rw_set(state_dir):
    cmd = f"{PROBE} write /tmp/outside; {PROBE} write /workspace/inside"
    r, ev = box(state_dir, ["/bin/sh", "-c", cmd], "isolation.user=nobody", "persistence=ephemeral",
                'isolation.landlock={"rw": ["/workspace", "/dev/null"], "ro": ["/"]}')
    out = output(ev)
    assert "write /tmp/outside Permission denied" in out, out
    assert "write /workspace/inside ok" in out, out
    assert started(ev)["enforcement"]["landlock"].startswith("ABI ")


def test_landlock_control_without_it_the_same_write_succeeds(state_dir):
    cmd = f"{PROBE} write /tmp/outside; {PROBE} write /workspace/inside"
    r, ev = box(state_dir, ["/bin/sh", "-c", cmd], "isolation.user=nobody", "persistence=ephemeral",
                "isolation.landlock=null")
    assert "write /tmp/outside ok" in output(ev), output(ev)


def test_landlock_is_not_applied_to_a_checkpointable_branch(state_dir):
    # criu does not restore Landlock: such a branch gets its filesystem policy from mounts only,
    # and box.started says so.
    cmd = f"{PROBE} write /tmp/outside"
    r, ev = box(state_dir, ["/bin/sh", "-c", cmd], "persistence=checkpoint",
                'isolation.landlock={"rw": ["/workspace"], "ro": ["/"]}')
    assert "write /tmp/outside ok" in output(ev)
    assert "criu" in started(ev)["enforcement"]["landlock"]


@pytest.fixture
def host_dir():
    """A directory on the host's root filesystem (the agent sees /var read-only; /tmp is its own)."""
    d = f"/var/tmp/sbx-policy-{uuid.uuid4().hex[:8]}"
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def setuid_copy(host_dir, src):
    dst = os.path.join(host_dir, "suid-" + os.path.basename(src))
    shutil.copy(src, dst)
    os.chown(dst, 0, 0)
    os.chmod(dst, 0o4755)
    os.chmod(host_dir, 0o755)
    return dst


# A setuid-root copy of a shell (bash -p keeps the euid it was given) and of the static probe,
# on the host's root, which honours setuid on the host and which the agent sees read-only (and
# nosuid) at /var: no_new_privs and nosuid both stop it.
SHELL_CHECK = ["-p", "-c", "echo ruid=$(id -ru) euid=$(id -u)"]


@pytest.mark.parametrize("src,args", [("/bin/bash", SHELL_CHECK), (str(PROBE), ["setuid-check"])])
def test_setuid_copy_gains_nothing_in_the_box(state_dir, host_dir, src, args):
    suid = setuid_copy(host_dir, src)
    r, ev = box(state_dir, [suid, *args], "isolation.user=nobody")
    assert "ruid=65534 euid=65534" in output(ev), output(ev)


@pytest.mark.parametrize("src,args", [("/bin/bash", SHELL_CHECK), (str(PROBE), ["setuid-check"])])
def test_setuid_copy_control_outside_the_box_does_gain(host_dir, src, args):
    # The same file on the same mount, run by the same user without no_new_privs: euid 0.
    suid = setuid_copy(host_dir, src)
    out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", suid, *args],
                         capture_output=True, text=True, timeout=10).stdout
    assert "ruid=65534 euid=0" in out, out


def secrets_layout(host_dir):
    home = os.path.join(host_dir, "home")
    files = {
        "token": os.path.join(home, ".local/state/sandboxer/tokens/box.token"),
        "aws": os.path.join(home, ".aws/credentials"),
        # A coding agent's login on the host (Claude Code's), and its key in the config file.
        "claude": os.path.join(home, ".claude/.credentials.json"),
        "claude_json": os.path.join(home, ".claude.json"),
        "public": os.path.join(host_dir, "public.txt"),
    }
    for f in files.values():
        os.makedirs(os.path.dirname(f), exist_ok=True)
        with open(f, "w") as fh:
            fh.write("secret-value\n")
    os.chmod(host_dir, 0o755)
    return home, files


def test_agent_cannot_read_or_touch_the_supervisor_and_its_secrets(host_dir):
    home, files = secrets_layout(host_dir)
    state = os.path.join(host_dir, "state")
    pidfile = os.path.join(host_dir, "pid")
    # The agent waits for the supervisor's real pid, then tries everything; it stays a moment
    # so the control can run against the same live supervisor.
    script = (f"while [ ! -s {pidfile} ]; do sleep 0.05; done; "
              f"{PROBE} read-secrets $(cat {pidfile}) {state}/box.json {files['token']} {files['aws']} "
              f"{files['claude']} {files['claude_json']} {files['public']}; sleep 2")
    env = dict(os.environ, HOME=home, SANDBOXER_TOKEN="tok-" + uuid.uuid4().hex)
    p = subprocess.Popen([str(INIT), "--state-dir", state, "--", "/bin/sh", "-c", script], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(p.pid))
        os.rename(pidfile + ".tmp", pidfile)
        # Control: the same probe outside the box reads and reaches all of it.
        time.sleep(0.5)
        ctl = subprocess.run([str(PROBE), "read-secrets", str(p.pid), f"{state}/box.json", files["token"],
                              files["aws"], files["claude"], files["claude_json"], files["public"]],
                             capture_output=True, text=True, timeout=10).stdout
        p.wait(timeout=30)
    finally:
        p.kill()
    assert ctl.count(" ok") == 9, ctl
    out = output(read_journal(state))
    lines = dict(l.split(" ", 1) if not l.startswith("read ") else (l.rsplit(" ", 1)[0], l.rsplit(" ", 1)[1])
                 for l in out.splitlines() if l)
    assert lines[f"read {files['public']}"] == "ok", out  # the agent does see the host's /var
    for key, val in lines.items():
        if key != f"read {files['public']}":
            assert val != "ok", (key, out)
    assert lines["ptrace"] != "ok" and lines["kill"] != "ok", out


def test_agent_runs_with_the_profile_user_caps_and_limits(state_dir):
    cmd = "id -u; id -g; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; cat /proc/self/oom_score_adj; " \
          "grep -E 'Max (core file size|open files)' /proc/self/limits"
    r, ev = box(state_dir, ["/bin/sh", "-c", cmd], "isolation.user=nobody", "isolation.capabilities=[]",
                "resources.open_files=256")
    out = output(ev)
    assert out.startswith("65534\n65534\n"), out
    assert "CapEff:\t0000000000000000" in out and "CapBnd:\t0000000000000000" in out
    assert "NoNewPrivs:\t1" in out
    assert "\n1000\n" in out
    assert any(l.startswith("Max core file size") and l.split()[4:6] == ["0", "0"] for l in out.splitlines()), out
    assert any(l.startswith("Max open files") and l.split()[3:5] == ["256", "256"] for l in out.splitlines()), out


def test_kept_capability_survives_for_a_non_root_agent(state_dir):
    r, ev = box(state_dir, ["/bin/grep", "CapEff", "/proc/self/status"], "isolation.user=1000",
                'isolation.capabilities=["CAP_NET_BIND_SERVICE"]')
    assert "CapEff:\t0000000000000400" in output(ev), output(ev)


def test_network_none_leaves_only_loopback(state_dir):
    loop = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "socket.create_connection(s.getsockname(), timeout=2); print('loopback-ok')")
    r, ev = box(state_dir, ["/bin/sh", "-c", f"cat /proc/net/dev; python3 -c \"{loop}\""], "network=none")
    ifaces = [l.split(":")[0].strip() for l in output(ev).splitlines() if ":" in l and "|" not in l]
    assert ifaces == ["lo"], output(ev)
    assert "loopback-ok" in output(ev), output(ev)  # lo is up


def test_network_control_host_sees_the_hosts_interfaces(state_dir):
    r, ev = box(state_dir, ["/bin/cat", "/proc/net/dev"], "network=host")
    ifaces = [l.split(":")[0].strip() for l in output(ev).splitlines() if ":" in l]
    assert len(ifaces) > 1, output(ev)


@pytest.mark.parametrize("override,field", [
    ("resources.memory=lots", "resources.memory"),
    ("resources.mem=1G", "resources.mem: unknown field"),
    ("resources.pids=1", "resources.pids"),
    ("resources.cpus=-1", "resources.cpus"),
    ('resources.cpus="two"', "resources.cpus"),
    ("resources.disk=10k", "resources.disk"),
    ("resources.timeout=soon", "resources.timeout"),
    ("resources.open_files=1073741824", "resources.open_files"),
    ('isolation.namespaces="yes"', "isolation.namespaces"),
    ("isolation.level=vm", "isolation.level"),
    ("isolation.user=alice", "isolation.user"),
    ('isolation.capabilities=["CAP_FLY"]', "isolation.capabilities[0]"),
    ('isolation.landlock={"rw": ["relative"]}', "isolation.landlock.rw[0]"),
    ("isolation.seccomp=strictest", "isolation.seccomp"),
    ("network=wifi", "network"),
    ("persistence=forever", "persistence"),
])
def test_bad_profile_value_is_refused_naming_the_field(state_dir, override, field):
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(state_dir),
                        "--set", override, "--", str(PROBE), "exit", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 125, (r.returncode, r.stderr)
    assert field in r.stderr, r.stderr


def test_isolation_level_above_what_the_host_gives_is_refused(state_dir):
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(state_dir),
                        "--set", "isolation.level=microvm", "--", str(PROBE), "exit", "0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and "isolation.level" in r.stderr and "microvm" in r.stderr, r.stderr


def test_bad_profile_control_good_values_start(state_dir):
    r, ev = box(state_dir, probe("exit", 0), "resources.memory=64M", "resources.cpus=0.5", "resources.pids=16",
                "resources.timeout=1h", "isolation.user=nobody", "isolation.level=process", "network=none")
    assert r.returncode == 0, r.stderr
    assert exited(ev)["reason"] == "exited"


def test_bad_profile_file_is_refused_naming_the_field(state_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "version": 1, "isolation": {"seccomp": "default", "colour": "red"}}))
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(state_dir),
                        "--profile", str(bad), "--", str(PROBE), "exit", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and "isolation.colour: unknown field" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["default", "untrusted", "claude-agent", "explorer"])
def test_shipped_profile_runs_an_agent(state_dir, name):
    r, ev = box(state_dir, probe("exit", 0), profile=name)
    assert r.returncode == 0, r.stderr
    st = started(ev)
    assert st["profile"] == name
    assert exited(ev)["reason"] == "exited"


def test_seccomp_policy_file(state_dir, tmp_path):
    pol = tmp_path / "pol.json"
    pol.write_text(json.dumps({"base": "none", "deny": ["unshare"], "enosys": ["setns"]}))
    r, ev = box(state_dir, probe("syscalls"), 'isolation.capabilities=["ALL"]', f"isolation.seccomp={pol}")
    res = syscall_results(ev)
    assert res["unshare"] == EPERM and res["setns"] == ENOSYS and res["mount"] != EPERM, res


def test_seccomp_program_is_built_once_and_cached_for_the_next_box(tmp_path):
    # The supervisor builds the profile's program and ns-init loads it as sent; the next box of
    # the same user reads it from the state dir (sandbox/policy.hpp, cached_seccomp) and its agent
    # is filtered all the same.
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    sets = ["--log-level", "debug", "--set", 'isolation.capabilities=["ALL"]', "--set", "network=none"]

    def run(name, *extra):
        r = run_init(sets + list(extra) + ["--"] + probe("syscalls"), tmp_path / name, env=env, text=True)
        ev = read_journal(tmp_path / name)
        assert r.returncode == 0, r.stderr
        return r.stderr, syscall_results(ev)

    log, res = run("first")
    assert "seccomp program built" in log and ", cached" in log, log
    files = sorted((tmp_path / "xdg" / "sandboxer").glob("seccomp-*.bpf"))
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o600, files
    assert res["mount"] == EPERM and res["clone3"] == ENOSYS, res

    log, res = run("second")
    assert "seccomp program from the cache" in log, log
    assert res["mount"] == EPERM and res["clone3"] == ENOSYS, res

    # Another policy is another program: built, and kept beside the first.
    pol = tmp_path / "pol.json"
    pol.write_text(json.dumps({"base": "none", "deny": ["unshare"]}))
    log, res = run("third", "--set", f"isolation.seccomp={pol}")
    assert "seccomp program built" in log, log
    assert res["unshare"] == EPERM and res["mount"] != EPERM, res
    assert len(list((tmp_path / "xdg" / "sandboxer").glob("seccomp-*.bpf"))) == 2


def test_state_dir_under_the_hosts_tmp_is_masked(tmp_path):
    # The branch sees the host's /tmp through an overlay; the state dir there is still masked,
    # while a file beside it (the control) is readable.
    state = tmp_path / "state"
    beside = tmp_path / "beside.txt"
    beside.write_text("visible\n")
    cmd = f"{PROBE} read-secrets 0 {state}/box.json {beside}"
    r, ev = box(state, ["/bin/sh", "-c", cmd])
    out = output(ev)
    assert f"read {beside} ok" in out, out
    assert f"read {state}/box.json No such file or directory" in out, out
