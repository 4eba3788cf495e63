"""Fork correctness (issue 15): what each live copy has of its own, checked from inside the copies
against the parent's value (so every assertion can fail), with the real criu of this host.

The agent (identity_agent.py) reads its facts, forks 2 copies through its agent channel, and each
of the three reads them again. The broker of each copy (network `proxy`) has tests of its own in
test_broker_fork.py; its machine-wide facts (a time namespace, a copy of a copy) in
test_checkpoint.py.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from sbxtest import INIT, ROOT, free_port_pair, read_journal

AGENT = pathlib.Path(__file__).resolve().parent / "identity_agent.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"

pytestmark = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    state = tmp_path_factory.mktemp("fork") / "s"
    env = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    port = free_port_pair()
    r = subprocess.run([str(INIT), "--state-dir", str(state), "--env", "SBX_AGENT_SDK", "--metrics-interval", "300ms",
                        "--", sys.executable,
                        str(AGENT), str(port)], capture_output=True, timeout=120, env=env, text=True)
    assert r.returncode == 0, r.stderr
    ev = read_journal(state)
    msgs = [e["message"] for e in ev if e["type"] == "proc.message"]
    before = next(m["before"] for m in msgs if "before" in m)
    after = {m["branch"]: m for m in msgs if "after" in m}
    done = [e for e in ev if e["type"] == "restore.done"]
    assert len(done) == 2 and {e["mode"] for e in done} == {"live"}, done
    assert set(after) == {"main"} | {e["branch"] for e in done}, after.keys()
    return before, after, ev


def copies(after):
    return [m for b, m in after.items() if b != "main"]


@pytest.mark.parametrize("fact", ["machine_id", "hostname", "getrandom", "pidns", "netns", "utsns"])
def test_each_copy_has_its_own(forked, fact):
    before, after, _ = forked
    values = [m["after"][fact] for m in copies(after)]
    # Not the parent's (before the fork, and after it: the parent keeps its own) ...
    assert after["main"]["after"][fact] == before[fact] or fact == "getrandom"
    assert all(v != before[fact] for v in values), (fact, before[fact], values)
    # ... and not each other's.
    assert len(set(values)) == len(values), (fact, values)


def test_a_copy_draws_its_own_random_numbers_after_on_restore(forked):
    before, after, _ = forked
    # The control: a generator the hook does not touch is the parent's memory, so every copy draws
    # what the parent draws. That is what `random` itself would do without the hook.
    own = {m["after"]["own_rng"] for m in after.values()}
    assert len(own) == 1, own
    # The module's generator was reseeded in each copy by sandboxer.agent before its hooks ran.
    drawn = [m["after"]["random"] for m in after.values()]
    assert len(set(drawn)) == len(drawn), drawn
    # The hooks ran once in each copy, told the copy's own branch; never in the parent.
    assert after["main"]["hooks"] == []
    for m in copies(after):
        assert m["hooks"] == [m["branch"]]


def test_no_copy_keeps_a_tcp_connection_of_its_parent(forked):
    _, after, _ = forked
    assert after["main"]["tcp"] == "open"
    assert [m["tcp"] for m in copies(after)] == ["closed", "closed"]


def test_each_copy_binds_the_same_port_in_a_network_of_its_own(forked):
    _, after, _ = forked
    assert all(m["bound"] is True for m in after.values()), [m["bound"] for m in after.values()]


def test_a_copys_channel_cannot_act_on_its_parent_or_siblings(forked):
    _, after, ev = forked
    fork_snapshot = next(e for e in ev if e["type"] == "fork.created")["snapshot"]
    for m in copies(after):
        assert m["refusals"]["delete_parent_snapshot"] == "forbidden"
        # Its past stays visible to it (it may fork from it) ...
        assert fork_snapshot in m["listed"]
    # ... and the snapshot a sibling took is the sibling's alone.
    taker = next(m for m in copies(after) if m["mine"])
    other = next(m for m in copies(after) if not m["mine"])
    made = [e for e in ev if e["type"] == "checkpoint.created" and e.get("snapshot") == taker["mine"]]
    assert made and made[0]["branch"] == taker["branch"]
    assert taker["mine"] in taker["listed"]  # the control: it is listed to the branch that took it
    assert taker["mine"] not in other["listed"]
    assert taker["mine"] not in after["main"]["listed"]
    # The fork snapshot was not deleted by any copy's attempt.
    assert not [e for e in ev if e["type"] == "snapshot.deleted"]


def test_metrics_say_each_copys_private_and_shared_memory(forked):
    _, after, ev = forked
    # Sampled while all three ran: before the first of them said its facts and began to end (a
    # sample taken as the parent exits has its heap half freed: 3 MB resident, 0.4 MB private).
    said = min(e["seq"] for e in ev if e["type"] == "proc.message" and "after" in e["message"])
    both = [e for e in ev if e["type"] == "metrics" and e["seq"] < said and set(after) <= set(e["branches"])
            and all(e["branches"][n]["memory"] > 0 for n in after)]
    assert both, "no metrics event while the parent and both copies ran"
    m = both[-1]
    for name in after:
        b = m["branches"][name]
        # The agent's own pages (a Python interpreter: megabytes) are private to each tree; the
        # proportional share and the private part never exceed what is resident.
        assert 1 << 20 < b["memory_private"] <= b["memory"], (name, b)
        assert b["memory_private"] <= b["memory_pss"] <= b["memory"], (name, b)
        assert b["memory_ksm"] >= 0
    box = m["box"]
    assert box["memory_private"] >= sum(m["branches"][n]["memory_private"] for n in after)
