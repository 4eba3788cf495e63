"""The general attacks of issue #13 (agents/attacks.py) under every shipped profile: the agent,
root inside its box (or the profile's user), goes after the supervisor (ptrace, /proc/PID/environ
and mem, process_vm_readv), its token, state dir and journal, makes namespaces and mounts, and
calls keyctl, userfaultfd, io_uring, bpf, perf_event_open, module loading and sethostname. Each
must fail with the reason asserted here; a fork bomb and a memory bomb end at their ceilings while
the supervisor goes on.

Controls: the same agent with the defence off (seccomp none and every capability; no namespaces)
where a profile field switches it off, and outside any box on this host as root where none does,
so each assertion can fail.

Attacks of other areas (mounts: /proc/sys, /sys, mknod; env: raw sockets, the operator's
environment) are run and asserted here too, under every profile; their own files
(test_mounts.py, test_env.py, test_netraw.py) hold the controls."""
import errno
import json
import os
import pathlib
import re
import secrets
import subprocess
import sys
import time

import pytest

from sbxtest import CLI, INIT, ROOT, WsBox, box, exited, of_type, read_journal, run_init, started

pytestmark = pytest.mark.timeout(120)

AGENT = ROOT / "tests" / "security" / "agents" / "attacks.py"
PROFILES = ["default", "untrusted", "claude-agent", "explorer"]
MARKER = "SBX_OPERATOR_MARKER"
EPERM, EACCES, ENOENT = errno.EPERM, errno.EACCES, errno.ENOENT

# What each attack of this area meets with: the errno the kernel or the filter gives.
SECCOMP = "the agent's seccomp filter"
REFUSED = {
    "ptrace_supervisor": ({EPERM}, SECCOMP),
    # /proc/PID/environ and mem are no syscalls the filter sees: the ptrace access check refuses
    # them (the agent lacks capabilities ns-init has, or is another user).
    "proc_environ_supervisor": ({EACCES}, "ptrace access check"),
    "proc_mem_supervisor": ({EACCES}, "ptrace access check"),
    "process_vm_readv_supervisor": ({EPERM}, SECCOMP),
    "unshare_user": ({EPERM}, SECCOMP),
    "unshare_mount": ({EPERM}, SECCOMP),
    "unshare_net": ({EPERM}, SECCOMP),
    "clone_newuser": ({EPERM}, SECCOMP),
    "setns": ({EPERM}, SECCOMP),
    "mount": ({EPERM}, SECCOMP),
    "fsopen": ({EPERM}, SECCOMP),
    "umount_mask": ({EPERM}, SECCOMP),
    "keyctl": ({EPERM}, SECCOMP),
    "userfaultfd": ({EPERM}, SECCOMP),
    "io_uring": ({EPERM}, SECCOMP),
    "bpf": ({EPERM}, SECCOMP),
    "perf_event_open": ({EPERM}, SECCOMP),
    "module_load": ({EPERM}, SECCOMP),
    "sethostname": ({EPERM}, SECCOMP),
}
# The supervisor's files are masked (an empty tmpfs, /dev/null) or out of a non-root agent's reach.
MASKED = ["read_token", "read_state_dir", "read_journal", "write_journal"]
# Other areas: (attack, area, profiles where the hole is still open on this branch).
OTHERS = [
    ("core_pattern", "mounts"),
    ("sysrq_trigger", "mounts"),
    ("sys_write", "mounts"),
    ("mknod_block", "mounts"),
    ("raw_socket", "env"),
    ("operator_env", "env"),
]


def attack_results(events):
    return {e["message"]["attack"]: e["message"] for e in of_type(events, "proc.message")
            if "attack" in e["message"]}


def run_attacks(tmp, *sets, profile="default", what="all"):
    """Runs the agent in a box of `profile` that serves the API (so there is a token to steal),
    with the operator's marker in the supervisor's environment. Returns (results, events)."""
    tmp = pathlib.Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    state = tmp / "state"
    token = tmp / "token"
    token.write_text(secrets.token_hex(16) + "\n")
    token.chmod(0o600)
    args = ["--profile", profile, "--listen", "127.0.0.1:0", "--token-file", str(token)]
    for s in sets:
        args += ["--set", s]
    argv = ["python3", str(AGENT), what, "--state", str(state), "--token", str(token), "--env-marker", MARKER]
    r = run_init(args + ["--"] + argv, state, timeout=90, env=dict(os.environ, **{MARKER: "operator-only"}))
    events = read_journal(state)
    res = attack_results(events)
    assert res, (r.returncode, r.stderr.decode()[-2000:])
    return res, events


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One box per shipped profile, run once for every test of the module."""
    cache = {}

    def get(profile):
        if profile not in cache:
            cache[profile] = run_attacks(tmp_path_factory.mktemp(f"escape-{profile}"), profile=profile)
        return cache[profile]
    return get


def why(r):
    return f"{r['attack']}: ok={r['ok']} {r['errname']} {r['detail']}"


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("attack", sorted(REFUSED))
def test_attack_is_refused(results, profile, attack):
    res, events = results(profile)
    r = res[attack]
    errnos, reason = REFUSED[attack]
    assert not r["ok"], why(r)
    assert r["errno"] in errnos, f"expected {[errno.errorcode[e] for e in errnos]} ({reason}): {why(r)}"
    assert started(events)["enforcement"]["seccomp"] == "default"


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("attack", MASKED)
def test_supervisor_files_are_out_of_reach(results, profile, attack):
    res, _ = results(profile)
    r = res[attack]
    assert not r["ok"], why(r)
    # A root agent finds a mask (an empty directory, a 0-byte file, no journal inside); the
    # untrusted agent (nobody) cannot even look.
    if profile == "untrusted":
        assert r["errno"] in (EACCES, ENOENT), why(r)
    else:
        assert r["errno"] == ENOENT or "masked" in r["detail"], why(r)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("attack", [a for a, _ in OTHERS])
def test_other_areas_attack_is_refused(results, profile, attack):
    res, _ = results(profile)
    assert not res[attack]["ok"], why(res[attack])


def test_the_agent_ran_every_attack_and_ended_normally(results):
    for profile in PROFILES:
        res, events = results(profile)
        assert set(res) == set(REFUSED) | set(MASKED) | {a for a, _ in OTHERS}, profile
        ex = exited(events)
        assert ex["reason"] == "exited" and ex["code"] == 0, (profile, ex)


# ---- controls -----------------------------------------------------------------------------------

# With the filter off and every capability kept, each of these works: the probe detects success.
WORK_WITHOUT_THE_DEFENCE = ["ptrace_supervisor", "proc_environ_supervisor", "proc_mem_supervisor",
                            "process_vm_readv_supervisor", "unshare_user", "unshare_mount", "unshare_net",
                            "clone_newuser", "setns", "mount", "fsopen", "umount_mask", "keyctl", "userfaultfd",
                            "io_uring", "bpf", "perf_event_open", "sethostname"]


def test_control_without_seccomp_and_with_every_capability_the_attacks_work(tmp_path):
    res, events = run_attacks(tmp_path, 'isolation.capabilities=["ALL"]', "isolation.seccomp=none")
    assert started(events)["enforcement"]["seccomp"] == "none"
    failed = [why(res[a]) for a in WORK_WITHOUT_THE_DEFENCE if not res[a]["ok"]]
    assert not failed, failed
    # This kernel has no module support at all: the call gets past the permission check and the
    # kernel answers ENOSYS (the filter answers EPERM before it).
    assert res["module_load"]["errno"] != EPERM, why(res["module_load"])
    assert os.uname().nodename in res["sethostname"]["detail"]


def test_control_without_namespaces_the_supervisors_files_are_readable(tmp_path):
    # No mount namespace, no masks: a root agent with DAC_OVERRIDE reads the token, the state dir
    # and the journal (why profiles that run untrusted code keep namespaces, or a non-root user).
    res, events = run_attacks(tmp_path, "isolation.namespaces=false", what="read_token,read_state_dir,read_journal,write_journal")
    assert started(events)["enforcement"]["filesystem"].startswith("not enforced")
    failed = [why(res[a]) for a in MASKED if not res[a]["ok"]]
    assert not failed, failed


def test_sethostname_is_refused_even_with_cap_sys_admin(tmp_path):
    # A branch shares the host's UTS namespace: with CAP_SYS_ADMIN kept, only the filter stops it
    # renaming the host. (The control above, without the filter, sets the host's own name again.)
    res, _ = run_attacks(tmp_path, 'isolation.capabilities=["ALL"]', what="sethostname")
    r = res["sethostname"]
    assert not r["ok"] and r["errno"] == EPERM, why(r)


def test_control_outside_any_box_root_reaches_a_supervisor(tmp_path):
    # The same agent on this host as root, against a live supervisor (given by pid, as the box's
    # is invisible to its agent), its token, state dir and journal: it gets them all.
    state = tmp_path / "state"
    token = tmp_path / "token"
    token.write_text("tok-" + secrets.token_hex(8) + "\n")
    token.chmod(0o600)
    p = subprocess.Popen([str(INIT), "--state-dir", str(state), "--listen", "127.0.0.1:0", "--token-file", str(token),
                          "--", "sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not list((state / "journal").glob("*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = subprocess.run([sys.executable, str(AGENT), "ptrace_supervisor,proc_mem_supervisor,read_token,"
                              "read_state_dir,read_journal,write_journal", "--only-pid", str(p.pid), "--state",
                              str(state), "--token", str(token)], capture_output=True, text=True, timeout=60).stdout
    finally:
        p.terminate()
        p.wait(timeout=30)
    res = {d["attack"]: d for d in map(json.loads, out.splitlines())}
    failed = [why(r) for r in res.values() if not r["ok"]]
    assert len(res) == 6 and not failed, (failed, out)


# ---- the supervisor itself, seen from a box without namespaces --------------------------------

DOCKER_DEFAULT_CAPS = json.loads((ROOT / "profiles" / "default.json").read_text())["isolation"]["capabilities"]
# What an agent of the default profile beside the API keeps of them (CAP_NET_RAW goes): a
# supervisor holding no more than this gives its ns-init nothing the agent lacks.
AGENT_CAPS = [c for c in DOCKER_DEFAULT_CAPS if c != "CAP_NET_RAW"]


def setpriv_caps(caps):
    """setpriv's prefix that leaves a root process exactly these capabilities (as a container
    without added capabilities gives its init)."""
    keep = ",".join("+" + c.lower().removeprefix("cap_") for c in caps)
    return ["setpriv", "--bounding-set", "-all," + keep, "--inh-caps", "-all"]


def test_supervisor_memory_is_closed_to_an_agent_holding_its_capabilities(tmp_path):
    # A box without namespaces shows the agent its supervisor (PID 1 here); with the supervisor
    # holding no more capabilities than the agent (Docker's defaults, as in a container `up`
    # starts without added ones), only the supervisor being non-dumpable keeps its memory and
    # environment (the token) closed.
    state = tmp_path / "state"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *setpriv_caps(DOCKER_DEFAULT_CAPS), str(INIT), "--state-dir",
           str(state), "--set", "isolation.namespaces=false", "--", "python3", str(AGENT),
           "ptrace_supervisor,proc_environ_supervisor,proc_mem_supervisor,process_vm_readv_supervisor",
           "--only-pid", "1"]
    r = subprocess.run(cmd, capture_output=True, timeout=60)
    res = attack_results(read_journal(state))
    assert len(res) == 4, r.stderr.decode()[-2000:]
    for a in ("proc_environ_supervisor", "proc_mem_supervisor"):
        assert not res[a]["ok"] and res[a]["errno"] == EACCES, why(res[a])
    for a in ("ptrace_supervisor", "process_vm_readv_supervisor"):
        assert not res[a]["ok"] and res[a]["errno"] == EPERM, why(res[a])


def test_ns_init_memory_is_closed_to_an_agent_holding_its_capabilities(tmp_path):
    # The same box: its ns-init (the agent's parent, outside the filter, holding the supervisor's
    # pipes) is visible too, and has no more capabilities than the agent. It is not dumpable
    # (ns-init.cpp): the kernel then wants CAP_SYS_PTRACE for its memory, which the agent lacks.
    # The control below is the same attack on a dumpable process of those capabilities.
    state = tmp_path / "state"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *setpriv_caps(AGENT_CAPS), str(INIT), "--state-dir",
           str(state), "--set", "isolation.namespaces=false", "--", "/bin/sh", "-c",
           f"python3 {AGENT} proc_mem_supervisor --only-pid $PPID; exit $?"]
    subprocess.run(cmd, capture_output=True, timeout=60)
    r = attack_results(read_journal(state))["proc_mem_supervisor"]
    assert not r["ok"], why(r)


def test_control_a_dumpable_process_with_the_same_capabilities_is_open(tmp_path):
    # The same attacker credentials against a process like the supervisor but dumpable (a sleep
    # with Docker's default capabilities): its memory and environment open.
    target = subprocess.Popen([*setpriv_caps(DOCKER_DEFAULT_CAPS), "sleep", "30"])
    try:
        time.sleep(0.2)
        out = subprocess.run([*setpriv_caps(DOCKER_DEFAULT_CAPS), sys.executable, str(AGENT),
                              "proc_environ_supervisor,proc_mem_supervisor", "--only-pid", str(target.pid)],
                             capture_output=True, text=True, timeout=60).stdout
    finally:
        target.kill()
        target.wait()
    res = {d["attack"]: d for d in map(json.loads, out.splitlines())}
    assert res["proc_environ_supervisor"]["ok"] and res["proc_mem_supervisor"]["ok"], out


# ---- bombs: the ceilings hold and the supervisor goes on ----------------------------------------

def journal_is_complete(events):
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in the journal"
    assert events[0]["type"] == "box.started"
    assert of_type(events, "proc.exited")


def profile_field(profile, section, field):
    return json.loads((ROOT / "profiles" / f"{profile}.json").read_text())[section][field]


@pytest.mark.parametrize("profile", PROFILES)
def test_fork_bomb_is_held_at_the_pids_ceiling_and_the_supervisor_answers(tmp_path, profile):
    # pids_grace raised so the question below lands while the bomb is still at the ceiling.
    with WsBox(tmp_path, ["python3", str(AGENT), "forkbomb"],
               extra=["--profile", profile, "--set", "resources.pids_grace=8s"]) as b:
        deadline = time.monotonic() + 60
        hit = None
        while hit is None and time.monotonic() < deadline:
            evs = b.read_events()
            hit = next((e for e in evs if e["type"] == "limit.hit" and e["limit"] == "pids"), None)
            time.sleep(0.1)
        assert hit, [e["type"] for e in evs]
        # The supervisor answers while the agent's tree is at its ceiling.
        stats = subprocess.run([str(CLI), "stats", b.url, "--json", "--token-file", str(b.token_file)],
                               capture_output=True, text=True, timeout=30)
        assert stats.returncode == 0, stats.stderr
        assert b.proc.wait(timeout=60) is not None
    events = read_journal(b.state)
    journal_is_complete(events)
    ceiling = profile_field(profile, "resources", "pids")
    assert hit["ceiling"] == ceiling and hit["value"] <= ceiling, hit
    assert exited(events)["reason"] == "pids_limit", exited(events)
    refused = [e["message"] for e in of_type(events, "proc.message") if e["message"].get("forkbomb") == "refused"]
    assert refused and refused[0]["after"] < ceiling and refused[0]["errno"] == errno.EAGAIN, refused


@pytest.mark.parametrize("profile", PROFILES)
def test_memory_bomb_ends_with_oom_and_the_supervisor_survives(state_dir, profile):
    r, events = box(state_dir, ["python3", str(AGENT), "membomb"], profile=profile, timeout=120)
    ex = exited(events)
    assert ex["reason"] == "oom" and ex["signal"] == "KILL", ex
    hit = [e for e in of_type(events, "limit.hit") if e["limit"] == "memory"]
    assert hit and hit[0]["oom_kills"] >= 1, hit
    # The supervisor itself outlived the bomb: it wrote the end and exited with the agent's status.
    assert r.returncode == 128 + 9, r.stderr.decode()[-2000:]
    journal_is_complete(events)
    held = [e["message"]["mib"] for e in of_type(events, "proc.message") if e["message"].get("membomb") == "held"]
    assert held and "done" not in json.dumps([e["message"] for e in of_type(events, "proc.message")])
    size = re.fullmatch(r"(\d+)([MG])", profile_field(profile, "resources", "memory"))
    assert size and max(held) <= int(size.group(1)) * (1024 if size.group(2) == "G" else 1), held
