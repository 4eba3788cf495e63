"""Process lifecycle: signals reach what they name, statuses are never lost, process ids are per
branch, and a checkpoint that fails (or a supervisor that dies mid-dump) never leaves the agent's
tree stopped (issue #13 item 12)."""
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import time

import pytest

from sbxtest import INIT, ROOT, Session, WsBox, pids_running, read_journal, run, ws_connect

HERE = pathlib.Path(__file__).resolve().parent

ATTACKS = HERE / "agents" / "channel.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"


def no_criu_env(path_prefix=None, **extra):
    path = ":".join(d for d in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(d, "criu")))
    if path_prefix:
        path = f"{path_prefix}:{path}"
    return dict(os.environ, PATH=path, SBX_AGENT_SDK=str(SDK), **extra)


def attack(*args):
    # The host's python3: the agent may run as nobody, who cannot reach a venv under /root.
    return ["/usr/bin/python3", str(ATTACKS), *[str(a) for a in args]]


def message(pred):
    return lambda e: e["type"] == "proc.message" and pred(e["message"])


def test_a_signal_to_a_copys_agent_reaches_it(tmp_path):
    with WsBox(tmp_path, attack("sleeper"), env=no_criu_env()) as b:
        b.wait_event(message(lambda m: m.get("ready") == "f1"))
        b.wait_event(message(lambda m: m.get("ready") == "main"))

        async def signals():
            async with ws_connect(b) as ws:
                s = Session(ws)
                return (await s.request("signal", proc="main@f1", signal="USR1"),
                        await s.request("signal", proc="nobody", signal="USR1"))

        ok, missing = run(signals())
        assert ok["ok"] is True, ok
        assert missing["ok"] is False and missing["error"]["code"] == "no_such_proc"
        got = b.wait_event(message(lambda m: "usr1" in m), timeout=10)
        assert got["message"]["usr1"] == "f1" and got["branch"] == "f1"
        # Control: the same request to the original's agent, by its own name.
        run(_signal(b, "main"))
        b.wait_event(message(lambda m: m.get("usr1") == "main"), timeout=10)


async def _signal(b, proc):
    async with ws_connect(b) as ws:
        r = await Session(ws).request("signal", proc=proc, signal="USR1")
        assert r["ok"] is True, r


# The agent leaves an orphan that ignores TERM and exits: ns-init reaps and waits out its grace
# period while exec'd processes end, all at once, with their own codes.
ORPHAN = ["sh", "-c", "(trap '' TERM; touch /workspace/ready; exec sleep 60) & "
          "while [ ! -e /workspace/ready ]; do sleep 0.01; done; exit 0"]
CODES = list(range(256))  # every exit status


def test_exit_statuses_of_execd_processes_are_not_lost_while_ns_init_reaps(tmp_path):
    with WsBox(tmp_path, ORPHAN, extra=["--set", "resources.grace=30s"], env=no_criu_env()) as b:
        deadline = time.monotonic() + 20
        while not (b.workspace / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # the agent has exited: ns-init is waiting out the orphan
        os.mkfifo(b.workspace / "go")

        async def execs():
            async with ws_connect(b) as ws:
                s = Session(ws)
                for c in CODES:
                    r = await s.request("exec", proc=f"p{c}", argv=["sh", "-c", f"read x < /workspace/go; exit {c}"])
                    assert r["ok"] is True, r
                idle = await s.request("exec", proc="idle", argv=["sleep", "60"])
                assert idle["ok"] is True, idle
                # Every one of them reads the fifo; its writer's close ends them all at one
                # instant, while a stream of harmless signals keeps ns-init's loop turning.
                await asyncio.sleep(1)
                flood = json.dumps({"op": "signal", "proc": "idle", "signal": "WINCH"})
                for i in range(2000):
                    if i == 500:
                        os.close(os.open(b.workspace / "go", os.O_WRONLY))
                    await s.ws.send(flood)
                await s.request("subscribe", since=0)
                done = {}
                while len(done) < len(CODES):
                    e = await s.wait_event(lambda e: e["type"] == "proc.exited" and e["proc"] not in done
                                           and e["proc"] not in ("main", "idle"), timeout=30)
                    done[e["proc"]] = e
                await s.request("shutdown", grace="0s")
                return done

        done = run(execs())
    for c in CODES:
        e = done[f"p{c}"]
        assert e.get("code") == c and "signal" not in e, (e, sorted(done.values(), key=lambda e: e["seq"])[:3])


def test_proc_ids_are_per_branch(tmp_path):
    with WsBox(tmp_path, attack("sleeper"), env=no_criu_env()) as b:
        b.wait_event(message(lambda m: m.get("ready") == "f1"))

        async def both():
            async with ws_connect(b) as ws:
                s = Session(ws)
                argv = ["sh", "-c", "echo $SANDBOXER_BRANCH; exec sleep 30"]
                r1 = await s.request("exec", proc="p1", argv=argv)
                r2 = await s.request("exec", proc="p1", argv=argv, branch="f1")
                # Each shell's echo before any signal: a TERM that came first would end it silent.
                await s.request("subscribe", since=0)
                for br in ("main", "f1"):
                    await s.wait_event(lambda e, br=br: e["type"] == "proc.output" and e["proc"] == "p1"
                                       and e["branch"] == br, timeout=20)
                ambiguous = await s.request("signal", proc="p1", signal="TERM")
                term = await s.request("signal", proc="p1", signal="TERM", branch="f1")
                ex = await s.wait_event(lambda e: e["type"] == "proc.exited" and e["proc"] == "p1", timeout=20)
                return r1, r2, ambiguous, term, ex

        r1, r2, ambiguous, term, ex = run(both())
    assert r1["ok"] and r2["ok"] and "existing" not in r2, (r1, r2)
    assert (r1["branch"], r2["branch"]) == ("main", "f1") and r1["pid"] != r2["pid"]
    assert ambiguous["ok"] is False and ambiguous["error"]["code"] == "ambiguous_proc", ambiguous
    assert "main" in ambiguous["error"]["message"] and "f1" in ambiguous["error"]["message"]
    assert term["ok"] is True and ex["branch"] == "f1" and ex["signal"] == "TERM"
    ev = read_journal(b.state)
    out = {e["branch"]: e["data"] for e in ev if e["type"] == "proc.output" and e["proc"] == "p1"}
    assert out == {"main": "main\n", "f1": "f1\n"}


def test_exec_by_the_agents_own_id_names_the_agent_never_a_new_process(tmp_path):
    # "main" in a copy is the copy's agent (main@f1): an exec by that id must not start a second
    # process that ns-init would report, and signal, as the agent.
    with WsBox(tmp_path, attack("sleeper"), env=no_criu_env()) as b:
        b.wait_event(message(lambda m: m.get("ready") == "f1"))

        async def go():
            async with ws_connect(b) as ws:
                s = Session(ws)
                argv = ["sh", "-c", "exec sleep 30"]
                return (await s.request("exec", proc="main", argv=argv, branch="f1"),
                        await s.request("exec", proc="main@f1", argv=argv, branch="f1"),
                        await s.request("exec", proc="main@f2", argv=argv, branch="f1"),
                        await s.request("exec", proc="main", argv=argv))
        in_copy, by_name, other, in_main = run(go())
    for r in (in_copy, by_name):
        assert r["ok"] and r["existing"] is True and r["proc"] == "main@f1", r
    assert other["ok"] is False and other["error"]["code"] == "bad_request", other
    assert "reserved" in other["error"]["message"]
    assert in_main["ok"] and in_main["existing"] is True and in_main["proc"] == "main", in_main
    # Nothing was started besides the agents.
    ev = read_journal(b.state)
    assert {(e["branch"], e["proc"]) for e in ev if e["type"] == "proc.started"} == {("main", "main"), ("f1", "main@f1")}


# A criu that claims 4.2.1, fills the kerndat cache on its /run when asked to probe (the box
# starts no criu on a tree before that cache is there), and, asked to dump, records its pid and
# arguments, then sleeps (the test kills it, or the supervisor) or fails at once.
FAKE_CRIU = '''#!/bin/sh
case "$1" in
  --version) echo "Version: 4.2.1"; exit 0;;
  check) {check};;
  dump) echo $$ > {dir}/criu.pid; echo "$@" > {dir}/criu.args; {then};;
esac
exit 1
'''


def fake_criu(tmp_path, then, check="echo probed > /run/criu.kdat; exit 0"):
    d = tmp_path / "fakebin"
    d.mkdir()
    (d / "criu").write_text(FAKE_CRIU.format(dir=tmp_path, then=then, check=check))
    (d / "criu").chmod(0o755)
    return d


def state_of(pid):
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return text[text.rindex(")") + 2]


def tree_root(tmp_path, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        args = tmp_path / "criu.args"
        if args.exists() and args.read_text().strip():
            a = args.read_text().split()
            return int(a[a.index("--tree") + 1]), int((tmp_path / "criu.pid").read_text())
        time.sleep(0.02)
    raise TimeoutError("criu was not started")


def children(pid):
    out = []
    for t in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        out += [int(x) for x in (t / "children").read_text().split()]
    return out


@pytest.mark.parametrize("how", ["criu fails", "criu is killed"])
def test_a_failed_dump_leaves_the_agent_running(tmp_path, how):
    fake = fake_criu(tmp_path, "exit 1" if how == "criu fails" else "sleep 60")
    s = tmp_path / "s"
    p = subprocess.Popen([str(INIT), "--state-dir", str(s), "--", *attack("dump")], env=no_criu_env(fake),
                         stderr=subprocess.PIPE, text=True)
    try:
        root, criu = tree_root(tmp_path)
        if how == "criu is killed":
            agent = children(root)[0]
            assert state_of(agent) == "T"  # stopped for the dump
            os.kill(criu, signal.SIGKILL)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    ev = read_journal(s)
    msgs = [e["message"] for e in ev if e["type"] == "proc.message"]
    answer = next(m["checkpoint"] for m in msgs if "checkpoint" in m)
    assert answer["ok"] is False and answer["code"] == "criu"
    assert ("killed by SIGKILL" in answer["message"]) == (how == "criu is killed")
    assert any(m.get("still_running") for m in msgs)


@pytest.mark.parametrize("warm,timeout", [("warm-up", None), ("checkpoint's own probe", "2s")])
def test_a_kernel_probe_that_does_not_end_is_killed_and_the_checkpoint_refused(tmp_path, warm, timeout):
    # criu's kernel probe (`criu check`) that hangs: the checkpoint waits for it at most
    # checkpoint.probe_timeout (10 s unless set), then is refused saying so, and the probe is killed,
    # whether the box's warm-up started it or the checkpoint did. The agent runs on.
    hang = f"{600 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    fake = fake_criu(tmp_path, "exit 1", check=f"exec sleep {hang}")
    s = tmp_path / "s"
    env = no_criu_env(fake, SANDBOXER_KDAT_WARM_MS="0" if warm == "warm-up" else "off")
    # The box outlives the answer: the probe must be gone while it runs, not only at its end. A
    # ticker beside the agent shows the loop serving on while the checkpoint waits.
    wait = "sleep 1; " if warm == "warm-up" else ""
    ticker = "(while :; do echo tick; sleep 0.2; done) & "
    agent = ["/bin/sh", "-c", f"{ticker}{wait}{' '.join(attack('dump'))}; exec sleep 60"]
    sets = ["--set", f"checkpoint.probe_timeout={timeout}"] if timeout else []
    p = subprocess.Popen([str(INIT), "--state-dir", str(s), *sets, "--", *agent], env=env, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not pids_running("sleep", hang):
            time.sleep(0.05)
        assert pids_running("sleep", hang), "the probe did not start"  # control: it hangs
        deadline, msgs = time.monotonic() + 30, []
        while time.monotonic() < deadline and not any(m.get("still_running") for m in msgs):
            assert p.poll() is None, p.stderr.read()[-3000:]
            time.sleep(0.1)
            msgs = [e["message"] for e in read_journal(s) if e["type"] == "proc.message"]
        assert not pids_running("sleep", hang), "the probe outlived the refusal"
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    answer = next(m["checkpoint"] for m in msgs if "checkpoint" in m)
    assert answer["ok"] is False and answer["code"] == "criu", answer
    limit = f"did not end within {timeout[:-1] if timeout else 10} s (checkpoint.probe_timeout)"
    assert "kerndat cache is empty" in answer["message"] and limit in answer["message"], answer
    assert not (tmp_path / "criu.args").exists(), "criu dumped without a cache"
    # The ticks written while it waited were journaled while it waited, not after its refusal.
    ev = read_journal(s)
    asked = next(e["seq"] for e in ev if e["type"] == "proc.message" and e["message"].get("asking"))
    failed = next(e["seq"] for e in ev if e["type"] == "checkpoint.failed")
    ticks = sum(e["data"].count("tick") for e in ev if e["type"] == "proc.output" and asked < e["seq"] < failed)
    assert ticks >= 5, (asked, failed, ticks)


def test_a_supervisor_that_dies_mid_dump_does_not_leave_the_tree_stopped(tmp_path):
    fake = fake_criu(tmp_path, "sleep 60")
    p = subprocess.Popen([str(INIT), "--state-dir", str(tmp_path / "s"), "--", *attack("dump")],
                         env=no_criu_env(fake), stderr=subprocess.DEVNULL)
    root, criu = tree_root(tmp_path)
    agent = children(root)[0]
    try:
        assert state_of(root) == "T" and state_of(agent) == "T"
        p.kill()  # the supervisor dies while the tree is stopped for the dump
        p.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (state_of(root) or state_of(agent)) not in (None, "Z"):
            time.sleep(0.05)
        assert state_of(agent) in (None, "Z") and state_of(root) in (None, "Z"), (state_of(root), state_of(agent))
    finally:
        for pid in (criu, agent, root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_shutdown_mid_dump_continues_the_tree_at_once(tmp_path):
    fake = fake_criu(tmp_path, "sleep 60")
    s = tmp_path / "s"
    p = subprocess.Popen([str(INIT), "--state-dir", str(s), "--set", "resources.grace=20s", "--", *attack("dump")],
                         env=no_criu_env(fake), stderr=subprocess.DEVNULL)
    try:
        tree_root(tmp_path)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=40)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    ev = read_journal(s)
    ended = next(e for e in ev if e["type"] == "proc.exited")
    # The agent got the TERM itself: not the backstop's KILL after the grace period.
    assert ended["reason"] == "shutdown" and ended.get("signal") == "TERM" and not ended.get("escalated"), ended
    assert took < 10, took
    failed = next(e for e in ev if e["type"] == "checkpoint.failed")
    assert failed["error"]["code"] in ("criu", "shutting_down")
