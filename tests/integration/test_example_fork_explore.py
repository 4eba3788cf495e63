"""examples/fork-explore on this machine: `run` starts a box with `sandboxer run --listen`, the
agent forks itself through the agent channel, and the driver gathers each copy's result from the
box's event stream, keeps the best and shuts the box down."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from sbxtest import CLI, ROOT, read_journal

RUN = ROOT / "examples" / "fork-explore" / "run"
SMALL = ["--copies", "3", "--cities", "150", "--moves", "30000", "--timeout", "90"]

needs_criu = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")


def run_example(state, *extra, rc=0):
    r = subprocess.run([str(RUN), "--json", "--state-dir", str(state), *SMALL, *extra], capture_output=True,
                       text=True, timeout=150, env=dict(os.environ, SANDBOXER_CLI=str(CLI), PYTHON=sys.executable))
    assert r.returncode == rc, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), read_journal(state)


def messages(events, step):
    return [e for e in events if e["type"] == "proc.message" and e["message"].get("step") == step]


@needs_criu
@pytest.mark.timeout(180)
def test_fork_explore_copies_continue_from_the_prefix_in_memory(tmp_path):
    s, events = run_example(tmp_path / "s")
    prefix = s["prefix"]
    assert s["live_checkpoint"] is True and s["checkpoint"]["mode"] == "live"
    copies = s["copies"]
    assert len(copies) == 3 and len({c["branch"] for c in copies}) == 3
    for c in copies:
        # Each copy found the prefix's state and the nonce that was only ever in memory, and
        # spent no time on the prefix: it continued from the checkpoint.
        assert c["mode"] == "live" and c["continued"] is True, c
        assert c["same_state"] and c["same_nonce"] and c["prefix_s"] == 0, c
        assert c["length"] <= prefix["start"]
    assert sorted(c["strategy"]["seed"] for c in copies) == [0, 1, 2]  # one strategy each
    assert s["best"]["length"] == min(c["length"] for c in copies)
    # The journal agrees: the prefix ran once, each result came on its own copy's stream.
    assert len(messages(events, "prefix")) == 1 and not messages(events, "cold_restart")
    results = {e["branch"]: e["message"] for e in messages(events, "result")}
    assert sorted(results) == sorted(c["branch"] for c in copies)
    assert all(results[c["branch"]]["length"] == c["length"] for c in copies)
    # Each copy's on_restore hook ran (with `random` reseeded: a salt of its own each).
    salts = [e["message"]["salt"] for e in messages(events, "continue")]
    assert None not in salts and len(set(salts)) == len(salts) == 3, salts
    # Each copy knew who it was from the channel, and its /run/sandboxer/branch.json agrees.
    for e in messages(events, "continue"):
        assert e["message"]["branch"] == e["branch"] == e["message"]["branch_json"]["branch"]
        assert e["message"]["branch_json"]["mode"] == "live" and e["message"]["branch_json"]["parent"] == "main"
    # The copies ended on their own; the driver then shut the box down (the original waited).
    exited = {e["branch"]: e for e in events if e["type"] == "proc.exited"}
    assert all(exited[c["branch"]]["reason"] == "exited" and exited[c["branch"]]["code"] == 0 for c in copies)
    assert exited["main"]["reason"] == "shutdown"
    assert messages(events, "stopped")[0]["branch"] == "main"


@pytest.mark.timeout(180)
def test_fork_explore_without_live_checkpoint_redoes_the_prefix_and_says_so(tmp_path):
    # No namespaces of its own: the checkpoint keeps only files, each fork is a cold restart
    # (SANDBOXER_RESUMED=1), and the agent redoes the prefix from the seed it wrote down.
    s, events = run_example(tmp_path / "s", "--set", "isolation.namespaces=false")
    assert s["live_checkpoint"] is False and s["checkpoint"]["mode"] == "fs"
    copies = s["copies"]
    assert len(copies) == 3
    for c in copies:
        assert c["mode"] == "cold" and c["continued"] is False, c
        assert c["same_state"] is True and c["same_nonce"] is False and c["prefix_s"] > 0, c
    assert len(messages(events, "cold_restart")) == 3
    assert s["best"]["length"] == min(c["length"] for c in copies)


@pytest.mark.timeout(120)
def test_fork_explore_reports_a_refused_fork_and_still_shuts_the_box_down(tmp_path):
    # Landlock does not survive criu, so the supervisor refuses the checkpoint; the example says
    # why, has no result to keep, exits 1, and the box still ends (the control is the live test).
    landlock = 'isolation.landlock={"rw": ["/workspace", "/tmp", "/dev"], "ro": ["/"]}'
    s, events = run_example(tmp_path / "s", "--set", landlock, rc=1)
    assert s["fork_failed"]["code"] == "landlocked" and "Landlock" in s["fork_failed"]["message"]
    assert s["copies"] == [] and s["best"] is None
    assert not any(e["type"] == "checkpoint.created" for e in events)
    assert [e["reason"] for e in events if e["type"] == "proc.exited"] == ["shutdown"]
