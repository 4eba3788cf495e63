"""Each example runs, under the real supervisor."""
import json
import subprocess

from conftest import CLI, ROOT, read_journal


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
