"""Each example runs, under the real supervisor."""
import subprocess

from sbxtest import CLI, ROOT, read_journal


def test_primes(tmp_path):
    state = tmp_path / "s"
    r = subprocess.run([str(CLI), "run", "--state-dir", str(state), "--", "python3",
                        str(ROOT / "examples/primes/agent.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main exited, code 0 (exited)" in r.stdout
    msgs = [e["message"] for e in read_journal(state) if e["type"] == "proc.message"]
    steps = [m["step"] for m in msgs]
    assert steps[0] == "plan" and steps[-1] == "report"
    # The first draft fails the check, the second passes.
    checks = [m for m in msgs if m["step"] == "check"]
    assert [c["ok"] for c in checks] == [False, True]
    report = msgs[-1]
    assert report["primes"][:5] == [2, 3, 5, 7, 11] and report["last"] == 229 and len(report["primes"]) == 50
    # The script it wrote is in its workspace, kept in the state dir.
    assert (state / "branches/main/workspace/primes.py").exists()


def test_long_horizon(tmp_path):
    """Left running with an idle limit: it ends with reason idle; detached clients lose nothing
    (the journal has every round); its metrics draw a plot."""
    import os
    state = tmp_path / "s"
    # The agent's environment is clean: its settings go in with --env (ROUNDS by name, from ours).
    env = dict(os.environ, ROUNDS="6")
    r = subprocess.run([str(CLI), "run", "--state-dir", str(state), "--json", "--env", "ROUNDS", "--env", "ROUND_SECONDS=0.3",
                        "--set", "resources.idle=2s", "--set", "resources.timeout=60s",
                        "--set", "metrics.interval=200ms", "--",
                        "python3", str(ROOT / "examples/long-horizon/agent.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    events = read_journal(state)
    ex = [e for e in events if e["type"] == "proc.exited"]
    assert ex and ex[-1]["reason"] == "idle", ex
    rounds = [e["message"]["round"] for e in events if e["type"] == "proc.message" and e["message"]["step"] == "round"]
    assert rounds == list(range(1, 7))
    assert len([e for e in events if e["type"] == "metrics"]) >= 5
    svg = tmp_path / "lh.svg"
    p = subprocess.run(["python3", str(ROOT / "examples/long-horizon/plot.py"), str(state), str(svg)],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, SANDBOXER_CLI=str(CLI)))
    assert p.returncode == 0, p.stderr
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<polyline") == 2
