"""sandboxer-init as PID 1: exit codes, signal forwarding, reaping, shutdown with grace."""
import json
import os
import secrets
import shutil
import signal
import subprocess
import time

import pytest

from sbxtest import CLI, INIT, PROBE, WsBox, read_journal, run_init, wait_event


def exited(events):
    ex = [e for e in events if e["type"] == "proc.exited"]
    assert len(ex) == 1, ex
    return ex[0]


def test_every_exit_code_comes_back_unchanged(tmp_path):
    # Exhaustive where cheap: 256 boxes, a few at a time.
    codes = list(range(256))
    for batch in range(0, 256, 16):
        procs = {}
        for c in codes[batch:batch + 16]:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir",
                   str(tmp_path / f"s{c}"), "--", str(PROBE), "exit", str(c)]
            procs[c] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for c, p in procs.items():
            _, err = p.communicate(timeout=60)
            assert p.returncode == c, (c, err)
    ev = exited(read_journal(tmp_path / "s255"))
    assert ev["code"] == 255 and ev["reason"] == "exited"


def start_box(state_dir, argv, *extra, env=None):
    """Starts a box as PID 1 of a new pid namespace, streaming events to a file."""
    events = state_dir.parent / "events.jsonl"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
           str(INIT), "--state-dir", str(state_dir), "--events", str(events), *extra, "--", *argv]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    return p, events


def wait_for_output(events_path, text, timeout=20):
    wait_event(events_path, lambda e: e["type"] == "proc.output" and text in e.get("data", ""), timeout)


def supervisor_pid(unshare_proc):
    """The pid (in our namespace) of sandboxer-init: unshare's only child."""
    for _ in range(200):
        kids = open(f"/proc/{unshare_proc.pid}/task/{unshare_proc.pid}/children").read().split()
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise AssertionError("unshare has no child")


FORWARDED = ["HUP", "INT", "QUIT", "USR1", "USR2", "WINCH"]


def test_forwarded_signals_reach_the_agent(tmp_path):
    # The agent writes into its own workspace (cwd); the host reads it from the state dir.
    record = tmp_path / "s" / "branches" / "main" / "workspace" / "received"
    p, events = start_box(tmp_path / "s", [str(PROBE), "catch", "received"])
    wait_for_output(events, "ready")
    sup = supervisor_pid(p)
    for name in FORWARDED:
        os.kill(sup, getattr(signal, "SIG" + name))
        deadline = time.time() + 10
        while time.time() < deadline and name not in (record.read_text().split() if record.exists() else []):
            time.sleep(0.01)
    os.kill(sup, signal.SIGTERM)
    p.wait(timeout=30)
    assert record.read_text().split() == FORWARDED + ["TERM"]
    assert p.returncode == 0
    ev = exited(read_journal(tmp_path / "s"))
    assert ev["code"] == 0 and ev["reason"] == "shutdown"


@pytest.mark.parametrize("name", ["HUP", "INT", "QUIT", "USR1", "USR2", "TERM"])
def test_a_terminating_signal_exits_128_plus_n(tmp_path, name):
    p, events = start_box(tmp_path / "s", [str(PROBE), "wait"])
    wait_for_output(events, "ready")
    signo = getattr(signal, "SIG" + name)
    os.kill(supervisor_pid(p), signo)
    p.wait(timeout=30)
    assert p.returncode == 128 + signo
    ev = exited(read_journal(tmp_path / "s"))
    assert ev["signal"] == name
    assert ev["reason"] == ("shutdown" if name == "TERM" else "signaled")


def test_orphans_are_reaped_while_the_agent_runs(tmp_path):
    r = run_init(["--", str(PROBE), "orphans", "100", "200"], tmp_path / "s")
    assert r.returncode == 0, r.stderr
    out = "".join(e.get("data", "") for e in read_journal(tmp_path / "s") if e["type"] == "proc.output")
    assert "zombies=0" in out, out


def test_control_a_bare_pid1_leaves_zombies(tmp_path):
    # The same orphan maker as PID 1 itself, which never reaps: the zombies are there to see,
    # so the test above can fail.
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(PROBE), "orphans", "100", "200"],
                       capture_output=True, timeout=60, text=True)
    assert "zombies=100" in r.stdout, r.stdout


@pytest.mark.parametrize("mode", [[], ["--set", "isolation.namespaces=false"]], ids=["namespaced", "flat"])
def test_nothing_of_the_tree_survives_the_agent(tmp_path, mode):
    # The agent leaves 5 daemons that ignore TERM; they are KILLed after the grace period (flat:
    # found as the subreaper's descendants through /proc). The marker is this run's own: the two
    # modes run side by side on pytest's workers, and each must see only its own tree.
    marker = f"tree-marker-{os.getpid()}-{len(mode)}"
    r = run_init([*mode, "--set", "resources.grace=1s", "--", str(PROBE), "leave-tree", "5", marker],
                 tmp_path / "s", as_pid1=False)
    assert r.returncode == 0, r.stderr
    left = subprocess.run(["pgrep", "-f", f"leave-tree 5 {marker}"], capture_output=True, text=True).stdout
    assert left.strip() == "", left
    ev = exited(read_journal(tmp_path / "s"))
    assert ev["code"] == 0 and ev.get("escalated") is True


@pytest.mark.parametrize("mode", [[], ["--set", "isolation.namespaces=false"]], ids=["namespaced", "flat"])
def test_an_agent_that_leaves_nothing_ends_without_escalation(tmp_path, mode):
    # The control of the test above: nothing left, nothing to kill.
    r = run_init([*mode, "--", "/bin/true"], tmp_path / "s", as_pid1=False)
    assert r.returncode == 0, r.stderr
    ev = exited(read_journal(tmp_path / "s"))
    assert ev["code"] == 0 and not ev.get("escalated")


def test_an_agent_that_ignores_term_is_killed_after_the_grace_period(tmp_path):
    p, events = start_box(tmp_path / "s", [str(PROBE), "ignore-term"], "--set", "resources.grace=1s")
    wait_for_output(events, "ready")
    t0 = time.monotonic()
    os.kill(supervisor_pid(p), signal.SIGTERM)
    p.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert p.returncode == 128 + signal.SIGKILL
    assert elapsed >= 0.9  # the grace period held
    ev = exited(read_journal(tmp_path / "s"))
    assert ev["signal"] == "KILL" and ev["reason"] == "shutdown" and ev["escalated"] is True


def test_not_pid1_becomes_a_subreaper_and_reaps(tmp_path):
    r = run_init(["--", str(PROBE), "orphans", "20", "100"], tmp_path / "s", as_pid1=False)
    assert r.returncode == 0, r.stderr
    out = "".join(e.get("data", "") for e in read_journal(tmp_path / "s") if e["type"] == "proc.output")
    assert "zombies=0" in out


def test_a_box_says_nothing_on_stderr_but_its_info_lines(tmp_path):
    # Against build-asan too (scripts/sanitize runs this file there): the branch's child runs on a
    # stack of its own (sandbox/launcher.cpp, clone_branch), where AddressSanitizer warned at its
    # first noreturn call that it ignored it and that false reports might follow.
    r = run_init(["--", "/bin/true"], tmp_path / "s", as_pid1=False)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.decode().splitlines() if ": info [" not in line] == [], r.stderr


def test_a_missing_binary_is_a_clear_error(tmp_path):
    r = run_init(["--", "/nonexistent/agent"], tmp_path / "s")
    assert r.returncode == 127
    ev = exited(read_journal(tmp_path / "s"))
    assert "exec /nonexistent/agent" in ev["error"] and "No such file" in ev["error"]
    assert ev["error"] == "exec /nonexistent/agent: No such file or directory", ev  # nothing to add


def test_a_missing_relative_or_path_program_says_where_it_was_looked_for(tmp_path):
    # `sandboxer run -- ./agent.sh` from the caller's directory: the agent starts in /workspace.
    (tmp_path / "agent.sh").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "agent.sh").chmod(0o755)
    r = run_init(["--", "./agent.sh"], tmp_path / "s", cwd=tmp_path)
    assert r.returncode == 127
    ev = exited(read_journal(tmp_path / "s"))
    assert ev["error"] == ("exec ./agent.sh: No such file or directory (relative to the agent's working "
                           "directory /workspace, not the caller's)"), ev
    r = run_init(["--", "no-such-program-here"], tmp_path / "s2")
    assert r.returncode == 127
    ev = exited(read_journal(tmp_path / "s2"))
    assert ev["error"].startswith("exec no-such-program-here: No such file or directory (looked for on the "
                                  "agent's PATH, /"), ev


def test_a_bad_profile_names_the_field(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text('{"name": "x", "version": 1, "resources": {"grase": "1s"}}')
    r = run_init(["--profile", str(prof), "--", "true"], tmp_path / "s")
    assert r.returncode == 125
    assert b"resources.grase: unknown field" in r.stderr


def test_pid1_writes_its_health_file_where_SANDBOXER_HEALTH_FILE_names_it(tmp_path):
    """A container whose /run is read-only names another file; `--health` reads the same one. A
    relative name is refused by both, with the variable named, and the box runs without one."""
    health = tmp_path / "h" / "init.json"
    env = dict(os.environ, SANDBOXER_HEALTH_FILE=str(health))
    check = lambda e: subprocess.run([str(INIT), "--health"], env=e, capture_output=True, text=True, timeout=30)
    r = check(env)
    assert r.returncode == 1 and f"read {health}" in r.stdout, r.stdout  # the control: nothing there yet
    p, events = start_box(tmp_path / "s", ["sleep", "30"], env=env)
    try:
        wait_event(events, lambda e: e["type"] == "proc.started")
        deadline = time.monotonic() + 20
        while not health.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert json.loads(health.read_text()) == {"pid": 1, "addr": "", "port": 0}
        r = check(env)
        assert r.returncode == 0 and "healthy: the supervisor (pid 1) runs" in r.stdout, r.stdout
    finally:
        p.kill()
        p.wait(timeout=30)
    rel = dict(os.environ, SANDBOXER_HEALTH_FILE="init.json")
    r = check(rel)
    assert r.returncode == 1 and 'SANDBOXER_HEALTH_FILE is "init.json": not an absolute path' in r.stdout, r.stdout
    r = run_init(["--", str(PROBE), "exit", "7"], tmp_path / "s2", env=rel, cwd=tmp_path)
    assert r.returncode == 7, r.stderr
    assert b'no health file: SANDBOXER_HEALTH_FILE is "init.json": not an absolute path' in r.stderr, r.stderr
    assert not (tmp_path / "init.json").exists()


def test_as_pid1_of_a_pid_namespace_the_agent_pid_is_real_even_when_it_exits_at_once(tmp_path):
    # /bin/true is gone (reaped by ns-init) before the supervisor reads the "started" report more
    # often than not: the pid comes from the kernel, not from ns-init's children. Several boxes, so
    # the old way (-1 whenever the agent was quicker) shows here.
    for i in range(8):
        s = tmp_path / f"s{i}"
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(s),
                            "--", str(PROBE), "exit", str(i)], capture_output=True, timeout=60)
        assert r.returncode == i, r.stderr
        ev = read_journal(s)
        types = [e["type"] for e in ev]
        assert types[:3] == ["box.started", "proc.started", "proc.exited"], types
        started = ev[1]
        # The supervisor is 1 in its namespace; ns-init is its child; the agent is ns-init's.
        assert started["pid"] > 1 and started["ns_pid"] >= 1, started
        assert exited(ev)["code"] == i


def ns_pids(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except OSError:
        return None
    return None


def descends_from(pid, ancestor):
    """Whether `ancestor` is `pid` or one of its parents (pids in nested namespaces repeat across
    boxes: only the process tree tells this box's agent from another's)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("PPid:"))
        except (OSError, StopIteration):
            return False
    return False


def test_as_pid1_of_a_pid_namespace_proc_started_names_the_running_agent(tmp_path):
    p, events = start_box(tmp_path / "s", [str(PROBE), "wait"])
    wait_for_output(events, "ready")
    started = [e for e in read_journal(tmp_path / "s") if e["type"] == "proc.started"][0]
    # The agent seen from here: its NSpid ends with the supervisor's view and the box's own view.
    sup = supervisor_pid(p)
    agent = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
             if (ns := ns_pids(pid)) and len(ns) >= 3 and ns[-2:] == [started["pid"], started["ns_pid"]]
             and descends_from(pid, sup)]
    assert len(agent) == 1, (started, agent)
    assert open(f"/proc/{agent[0]}/cmdline").read().split("\0")[1] == "wait"
    os.kill(sup, signal.SIGTERM)
    p.wait(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM
    assert exited(read_journal(tmp_path / "s"))["reason"] == "shutdown"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
def test_where_namespaces_cannot_be_made_the_box_says_so_from_the_agents_own_clone():
    # No throwaway probe clone at start: the branch's clone finds out, falls back, and box.started
    # says why. As nobody, without capabilities, clone(CLONE_NEWPID) is refused.
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="sbx-nobody-")
    try:
        os.chown(d, 65534, 65534)  # its home: a state dir below one others may write is refused
        # The profile's user and capabilities need privileges nobody lacks (the test below).
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                            "env", f"HOME={d}", str(INIT), "--state-dir", f"{d}/s", "--set", "isolation.user=null",
                            "--set", "isolation.capabilities=null", "--", "/bin/sh", "-c", "id -u"],
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ev = read_journal(f"{d}/s")
        assert [e["data"] for e in ev if e["type"] == "proc.output"] == ["65534\n"], ev
        started = ev[0]
        assert started["type"] == "box.started"
        caps = started["capabilities"]
        assert caps["namespaces"] is False, caps
        assert caps["namespaces_why_not"].startswith("clone(CLONE_NEWPID|CLONE_NEWNS)"), caps
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_as_pid1_under_the_hosts_proc_the_box_mounts_a_proc_of_its_own(tmp_path):
    # `unshare --pid --fork` without --mount-proc, as a new user would try it: /proc is the host's.
    # The control: a process there is named by NSpid in both namespaces, so /proc/N by a pid of
    # the new namespace is a host process (/proc/2 is kthreadd, whose root is the host's /). The
    # box once took its branch's /tmp from /proc/<ns-init>/root, which wrote a client's file into
    # the host's /tmp, summed the host's processes in its stats, and could not checkpoint.
    r = subprocess.run(["unshare", "--pid", "--fork", "grep", "^NSpid:", "/proc/self/status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and len(r.stdout.split()) == 3 and r.stdout.split()[-1] == "1", r.stdout
    name = f"sbx-proc-{secrets.token_hex(6)}"
    src = tmp_path / "src.txt"
    src.write_text("for the box's /tmp\n")
    # Without criu's warm-up probe, whose processes (criu and a child of its kernel probe) the
    # box's count would include while it runs: a slow sanitizer build counted 4.
    env = dict(os.environ, SANDBOXER_KDAT_WARM_MS="off")
    with WsBox(tmp_path, ["sleep", "120"], as_pid1=True, mount_proc=False, env=env) as box:
        assert "/proc was another pid namespace's (NSpid " in box.stderr(), box.stderr()
        cli = lambda *a: subprocess.run([str(CLI), a[0], "--token-file", str(box.token_file), *a[1:]],
                                        capture_output=True, text=True, timeout=120)
        r = cli("cp", str(src), f"{box.url}:/tmp/{name}")
        assert r.returncode == 0, r.stderr
        try:
            assert not os.path.exists(f"/tmp/{name}")
        finally:
            if os.path.exists(f"/tmp/{name}"):
                os.unlink(f"/tmp/{name}")
        r = cli("exec", box.url, "--", "cat", f"/tmp/{name}")
        assert r.returncode == 0 and r.stdout == "for the box's /tmp\n", (r.stdout, r.stderr)
        r = cli("stats", box.url, "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        # The branch's tree from its ns-init: ns-init and sleep (the host's pid 2 is kthreadd, with
        # every kernel thread below it). The box adds only the supervisor's own children: none here.
        assert st["branches"]["main"]["pids"] == 2, st
        assert st["box"]["pids"] == 2, st
        if shutil.which("criu"):
            r = cli("checkpoint", box.url)
            assert r.returncode == 0, r.stderr
            assert f"sandboxer checkpoint: {r.stdout.split()[-1]} live (" in r.stderr, r.stderr


ROOTLESS = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
@pytest.mark.parametrize("net", [True, False], ids=["own-network", "host-network"])
def test_rootless_in_a_user_namespace_an_unprivileged_user_made_the_agent_runs(net):
    # `unshare --user --map-root-user`, as nobody: the agent's root is nobody outside. There the
    # kernel denies setgroups(2) to every process (the control, below); the box's policy called it
    # and every agent ended with 127 ("apply policy: setgroups: Operation not permitted").
    import tempfile
    userns = ["unshare", "--user", "--map-root-user", *(["--net"] if net else []), "--pid", "--fork", "--mount-proc"]
    r = subprocess.run([*ROOTLESS, *userns, "python3", "-c",
                        "import os\nprint(open('/proc/self/setgroups').read().strip())\n"
                        "try:\n    os.setgroups([])\nexcept PermissionError as e:\n    print('refused', e.errno)"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split("\n")[:2] == ["deny", "refused 1"], (r.stdout, r.stderr)
    d = tempfile.mkdtemp(prefix="sbx-rootless-")
    try:
        os.chmod(d, 0o777)
        r = subprocess.run([*ROOTLESS, "env", f"HOME={d}", *userns, str(INIT), "--state-dir", f"{d}/s", "--",
                            "/bin/sh", "-c", "id -u; id -g"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ev = read_journal(f"{d}/s")
        assert "".join(e["data"] for e in ev if e["type"] == "proc.output") == "0\n0\n", ev
        started = ev[0]
        assert "supplementary groups the supervisor's" in started["enforcement"]["user"], started["enforcement"]
        # With a network namespace of its own, the user namespace's root may mount the branch's
        # sysfs: the branch gets its pid and mount namespaces. Without one it may not, and the box
        # runs without them, saying why.
        caps = started["capabilities"]
        assert caps["namespaces"] is net, caps
        if not net:
            assert "mount /sys" in caps["namespaces_why_not"], caps
        # criu cannot suspend the agent's seccomp filter from a user namespace (its dump failed:
        # "suspending seccomp failed: Operation not permitted"): the box does not claim it can.
        assert caps["live_checkpoint"] is False, caps
        assert caps["why_not"].startswith("the supervisor runs in a user namespace of its own (rootless)"), caps
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
def test_a_supervisor_without_privileges_refuses_a_profile_it_cannot_apply(tmp_path):
    # As nobody, the default profile's user (0:0) and capabilities cannot be applied: every agent
    # once ended with 127 at its first step ("apply policy: oom_score_adj: Permission denied"),
    # after box.started. Now the box does not start, and says what it lacks and what to do.
    import tempfile
    d = tempfile.mkdtemp(prefix="sbx-nobody-")
    try:
        os.chown(d, 65534, 65534)  # its home: a state dir below one others may write is refused
        r = subprocess.run([*ROOTLESS, "env", f"HOME={d}", str(INIT), "--state-dir", f"{d}/s", "--", "/bin/true"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 125, r.stderr
        assert ("isolation: the profile runs its agent as 0:0 and narrows its capabilities, which takes "
                "CAP_SETGID, CAP_SETUID and CAP_SETPCAP, and this supervisor (uid 65534) does not hold them") in r.stderr
        assert "unshare --user --map-root-user --net --pid --fork --mount-proc" in r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_pid1_removes_its_own_health_file_at_its_end_and_no_other(tmp_path):
    # Under `unshare --pid --fork` on a host, every box is PID 1 and shares the host's /run: each
    # once left /run/sandboxer/init.json behind, naming pid 1. Two boxes on one file: the first to
    # end leaves the second's; the second removes its own.
    health = tmp_path / "h" / "init.json"
    env = dict(os.environ, SANDBOXER_HEALTH_FILE=str(health))

    def started_box(name, other=None):
        p, events = start_box(tmp_path / name, ["sleep", "60"], env=env)
        wait_event(events, lambda e: e["type"] == "proc.started")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                st = health.stat()
                if (st.st_dev, st.st_ino) != other:  # its own, once written (a rename over the other's)
                    return p, (st.st_dev, st.st_ino)
            except FileNotFoundError:
                pass
            time.sleep(0.02)
        raise AssertionError("no health file of its own")

    a, a_file = started_box("a")
    b, b_file = started_box("b", other=a_file)
    os.kill(supervisor_pid(a), signal.SIGTERM)
    a.wait(timeout=30)
    st = health.stat()
    assert (st.st_dev, st.st_ino) == b_file  # a's end left b's file
    os.kill(supervisor_pid(b), signal.SIGTERM)
    b.wait(timeout=30)
    assert not health.exists()


def test_a_pid1_on_a_hosts_run_leaves_no_sandboxer_dir_there_and_keeps_what_is_not_its_own(tmp_path):
    # The default health file is /run/sandboxer/init.json. Under `unshare --pid --fork` on a host,
    # that is the host's /run: the box made /run/sandboxer there and left it, empty, at its end.
    # Here /run is a tmpfs of the test's own mount namespace; the host's is never touched.
    def run_on_a_run(before):
        shutil.rmtree(tmp_path / "s", ignore_errors=True)
        script = f"""
            mount -t tmpfs none /run || exit 9
            {before}
            unshare --pid --fork --mount-proc {INIT} --state-dir {tmp_path / 's'} -- sleep 60 &
            u=$!
            i=0; while [ ! -s /run/sandboxer/init.json ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done
            echo seen=$(ls /run/sandboxer | tr '\\n' ,)
            kill -TERM $(pgrep -P $u)
            wait $u
            find /run -mindepth 1 | sort
        """
        env = {k: v for k, v in os.environ.items() if k != "SANDBOXER_HEALTH_FILE"}  # the default file
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                           capture_output=True, text=True, timeout=60, env=env)
        return r.stdout.split()

    # The box wrote its file there while it ran (the control), and nothing is left.
    out = run_on_a_run("")
    assert out == ["seen=init.json,"], out
    # Something else in that directory keeps it; the box's file still goes.
    out = run_on_a_run("mkdir /run/sandboxer && touch /run/sandboxer/other")
    assert out == ["seen=init.json,other,", "/run/sandboxer", "/run/sandboxer/other"], out


@pytest.mark.parametrize("args, message", [
    (["--listen", "127.0.0.1:0", "--token-file", "{fifo}"], "read --token-file {fifo}: No data available"),
    (["--profile", "{fifo}"], "profile {fifo}: No data available"),
    (["--listen", "127.0.0.1:0", "--token-file", "{token}", "--tls-cert", "{fifo}", "--tls-key", "{fifo}"],
     "--tls-cert {fifo}: not a regular file (a FIFO)"),
])
def test_a_fifo_nothing_writes_given_as_an_input_file_is_refused_at_once(tmp_path, args, message):
    # Its open waited for a writer, before the supervisor's loop answers any signal: a TERM did
    # nothing, and only KILL ended it (the control of this run: its timeout).
    fifo, token = tmp_path / "fifo", tmp_path / "token"
    os.mkfifo(fifo)
    token.write_text(secrets.token_hex(16))
    fill = lambda s: s.format(fifo=fifo, token=token)
    r = run_init([*map(fill, args), "--", "/bin/true"], tmp_path / "s", timeout=30)
    assert r.returncode == 125 and fill(message).encode() in r.stderr, r.stderr


def test_a_token_file_that_is_a_pipe_with_a_writer_is_read_to_its_end(tmp_path):
    # `--token-file <(cmd)`: the token comes from a pipe the shell's child writes.
    rd, wr = os.pipe()
    os.write(wr, b"token-from-a-pipe-0123456789abcdef\n")
    os.close(wr)
    try:
        r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                            "--token-file", f"/dev/fd/{rd}", "--", "/bin/true"],
                           pass_fds=[rd], capture_output=True, timeout=30)
    finally:
        os.close(rd)
    assert r.returncode == 0, r.stderr
    assert any(e["type"] == "server.listening" for e in read_journal(tmp_path / "s"))


def test_a_second_box_on_a_state_dir_in_use_is_refused_and_the_first_goes_on(tmp_path):
    # Run twice by mistake (a script's retry, a second terminal): the second supervisor took the
    # first's box id, journal and cgroups, killed its agent as "processes of an earlier run of
    # this box", then failed itself. Now the state dir is locked while a supervisor runs on it.
    state = tmp_path / "s"
    events = tmp_path / "first.jsonl"
    gate = state / "branches" / "main" / "workspace" / "go"  # /workspace/go inside
    first = subprocess.Popen([str(INIT), "--state-dir", str(state), "--events", str(events), "--", "sh", "-c",
                              "echo started; while [ ! -e /workspace/go ]; do sleep 0.05; done; echo done"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_event(events, lambda e: e["type"] == "proc.output" and "started" in e.get("data", ""))
        r = run_init(["--", "sh", "-c", "echo second"], state, as_pid1=False, text=True)
        assert r.returncode == 125, r.stderr
        assert (f"state dir {state} is in use by another box (sandboxer-init, pid {first.pid}): "
                "stop it first, or give this box a state dir of its own") in r.stderr, r.stderr
        gate.touch()
        assert first.wait(timeout=30) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    ev = read_journal(state)
    assert "".join(e["data"] for e in ev if e["type"] == "proc.output") == "started\ndone\n", ev
    ex = [e for e in ev if e["type"] == "proc.exited"]
    assert len(ex) == 1 and ex[0]["code"] == 0 and ex[0]["reason"] == "exited", ex
    # The lock goes with the supervisor: the next box on the state dir starts.
    r = run_init(["--", "sh", "-c", "echo third"], state, as_pid1=False, text=True)
    assert r.returncode == 0, r.stderr
    ev = read_journal(state)
    assert [e["data"] for e in ev if e["type"] == "proc.output"][-1] == "third\n"
    assert len([e for e in ev if e["type"] == "box.started"]) == 2
