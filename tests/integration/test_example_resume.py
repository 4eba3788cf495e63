"""examples/resume under the real supervisor: stopped mid-run, started again on the same files
with SANDBOXER_RESUMED=1 and SANDBOXER_SNAPSHOT (what the cold-restart fallback sets), it
finishes exactly where an uninterrupted run would."""
import hashlib
import json
import os
import signal
import subprocess
import time

from sbxtest import CLI, ROOT, read_journal

AGENT = str(ROOT / "examples/resume/agent.py")
STEPS = 6


def expected_final():
    value = "sandboxer"
    for i in range(STEPS):
        value = hashlib.sha256(f"{value}:{i}".encode()).hexdigest()
    return value


# The agent's environment is clean: its settings are named with --env (their values are ours).
PASS = ["--env", "RESUME_STEPS", "--env", "RESUME_STEP_SECONDS"]


def messages(state, since=0):
    return [e["message"] for e in read_journal(state, since) if e["type"] == "proc.message"]


def test_resumed_agent_continues_from_its_session_file(tmp_path):
    state = tmp_path / "s"
    env = {**os.environ, "RESUME_STEPS": str(STEPS), "RESUME_STEP_SECONDS": "0.3"}
    first = subprocess.Popen([str(CLI), "run", "--state-dir", str(state), "--json", *PASS, "--", "python3", AGENT],
                             env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    try:
        for line in first.stdout:
            event = json.loads(line)
            if event.get("type") == "proc.message" and event["message"].get("i") == 2:
                break
            assert time.monotonic() < deadline, "the agent did not reach step 2"
        first.send_signal(signal.SIGTERM)  # the box goes away mid-run
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    done_first = [m["i"] for m in messages(state) if m["step"] == "work"]
    assert 2 in done_first and len(done_first) < STEPS
    last_seq = read_journal(state)[-1]["seq"]

    # The cold restart by hand: the same command on the same files, told it was resumed. The
    # variables go through `env` in the command itself, so this does not depend on which
    # SANDBOXER_* variables the supervisor passes on from its own environment; the supervisor's
    # own fallback (restore of a files-only snapshot) sets them itself.
    r = subprocess.run([str(CLI), "run", "--state-dir", str(state), *PASS, "--", "env", "SANDBOXER_RESUMED=1",
                        "SANDBOXER_SNAPSHOT=snap-1", "python3", AGENT],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    second = messages(state, since=last_seq)
    assert second[0] == {"step": "resumed", "snapshot": "snap-1", "done": len(done_first)}
    assert [m["i"] for m in second if m["step"] == "work"] == list(range(len(done_first), STEPS))
    report = second[-1]
    assert report["step"] == "report" and report["resumed"] is True
    assert report["final"] == expected_final()


def test_without_resumed_it_starts_over(tmp_path):
    # Control: the same agent on the same files, not told it was resumed, starts from step 0.
    state = tmp_path / "s"
    env = {**os.environ, "RESUME_STEPS": "2", "RESUME_STEP_SECONDS": "0"}
    for _ in range(2):
        r = subprocess.run([str(CLI), "run", "--state-dir", str(state), *PASS, "--", "python3", AGENT],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    runs = [m for m in messages(state) if m["step"] in ("start", "resumed")]
    assert [m["step"] for m in runs] == ["start", "start"]
    assert [m["i"] for m in messages(state) if m["step"] == "work"] == [0, 1, 0, 1]
