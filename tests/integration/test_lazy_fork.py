"""Forks restored with criu's lazy pages, the eager fallback, and the dump's pause and profile,
with the real criu of this host (root needed).

The agent (live_agent.py, mode fork) holds HEAP_MB of random heap and a counter, forks 4 copies
through its agent channel, and each copy reports its counter and its heap's checksum."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from sbxtest import INIT, ROOT, free_port_pair, read_journal

AGENT = pathlib.Path(__file__).resolve().parent / "live_agent.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"
HEAP_MB = 32

needs_criu = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")


def fork_box(state_dir, **env):
    e = dict(os.environ, SBX_AGENT_SDK=str(SDK), **env)
    p = free_port_pair()
    r = subprocess.run([str(INIT), "--state-dir", str(state_dir), "--env", "SBX_AGENT_SDK", "--", sys.executable,
                        str(AGENT), "fork", str(p), str(HEAP_MB), "1.5"],
                       capture_output=True, timeout=120, env=e, text=True)
    assert r.returncode == 0, r.stderr
    return read_journal(state_dir)


def copies_continue(ev):
    """Every copy continues the original's state: the same counter, nonce and heap checksum."""
    msgs = [e for e in ev if e["type"] == "proc.message"]
    start = next(e["message"] for e in msgs if e["message"].get("start"))
    after = {e["branch"]: e["message"] for e in msgs if e["message"].get("after")}
    done = [e for e in ev if e["type"] == "restore.done"]
    assert len(done) == 4 and {e["mode"] for e in done} == {"live"}
    for d in done:
        a = after[d["branch"]]
        assert a["copy"] is True and a["n"] == 4 and a["counter"] == ["1", "2", "3", "4"]
        assert a["nonce"] == start["nonce"] and a["sum"] == start["sum"]
    return done


@needs_criu
def test_lazy_copies_continue_the_agent_and_their_memory_completes(tmp_path):
    ev = fork_box(tmp_path / "s")
    done = copies_continue(ev)
    # The fork's copies start before its snapshot is sealed: an event of a copy names the snapshot
    # once it is (fork.created's), null before.
    (fork,) = [e for e in ev if e["type"] == "fork.created"]
    heap_pages = HEAP_MB << 20 >> 12
    for d in done:
        assert d["lazy"] is True and "lazy_why" not in d
        # criu itself restored only the pages it needs to start the tree; the heap came from the
        # copy's lazy-pages daemon (the eager test below is the control: all of it there).
        assert d["timings_ms"]["criu"]["pages_restored"] < heap_pages // 2, d
        complete = [e for e in ev if e["type"] == "restore.memory_complete" and e["branch"] == d["branch"]]
        assert len(complete) == 1, complete
        assert complete[0]["ok"] is True and complete[0]["seq"] > d["seq"]
        assert complete[0]["index"] == d["index"]
        assert {complete[0]["snapshot"], d["snapshot"]} <= {fork["snapshot"], None} and fork["snapshot"]
    # Each copy had a daemon of its own, and none is left behind.
    for d in done:
        assert (tmp_path / "s" / "branches" / d["branch"] / ".criu" / "lazy-pages.log").exists()


@needs_criu
def test_without_lazy_pages_copies_restore_eagerly_and_say_why(tmp_path):
    ev = fork_box(tmp_path / "s", SANDBOXER_LAZY_PAGES="0")
    done = copies_continue(ev)
    heap_pages = HEAP_MB << 20 >> 12
    for d in done:
        assert d["lazy"] is False and "SANDBOXER_LAZY_PAGES=0" in d["lazy_why"]
        assert d["timings_ms"]["criu"]["pages_restored"] >= heap_pages, d
    assert not [e for e in ev if e["type"] == "restore.memory_complete"]


@needs_criu
def test_the_checkpoint_says_the_agents_pause_and_criu_phases(tmp_path):
    ev = fork_box(tmp_path / "s", SANDBOXER_LAZY_PAGES="0")
    created = next(e for e in ev if e["type"] == "checkpoint.created")
    t = created["timings_ms"]
    # The archive is compressed and hashed after the agent runs again: the pause leaves it out.
    assert created["pause_ms"] == t["freeze"] and created["total_ms"] == t["total"]
    assert created["pause_ms"] + t["compress"] <= created["total_ms"] + 0.2
    assert created["pause_ms"] < created["total_ms"]
    criu = t["criu"]
    assert criu["pages_written"] >= HEAP_MB << 20 >> 12
    for k in ("freezing", "frozen", "memdump", "memwrite"):
        assert criu[k] >= 0
    # The agent's own 'tick' messages stop at the pause and go on after it (it was resumed).
    ticks = [e for e in ev if e["type"] == "proc.message" and e["branch"] == "main" and "n" in e["message"]]
    assert ticks and any(e["seq"] > created["seq"] for e in ticks)


KSM = pathlib.Path("/sys/kernel/mm/ksm")


def ksm_writable():
    try:
        (KSM / "run").write_text((KSM / "run").read_text())
        return True
    except OSError:
        return False


@pytest.fixture
def ksm_running():
    """KSM on and scanning fast for the test; the host's settings back afterwards."""
    if not (KSM / "run").exists() or os.geteuid() != 0 or not ksm_writable():
        pytest.skip("needs root and a writable /sys/kernel/mm/ksm/run")
    keys = ("run", "pages_to_scan", "sleep_millisecs")
    saved = {k: (KSM / k).read_text().strip() for k in keys}
    try:
        (KSM / "pages_to_scan").write_text("20000")
        (KSM / "sleep_millisecs").write_text("5")
        (KSM / "run").write_text("1")
        yield
    finally:
        for k in keys:
            (KSM / k).write_text(saved[k])


def most_pages_sharing(state_dir, *extra):
    """Runs the fork agent (its copies linger 6 s) and samples pages_sharing meanwhile: the
    largest growth over its value at the start, and the journal."""
    base = int((KSM / "pages_sharing").read_text())
    e = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    p = subprocess.Popen([str(INIT), "--state-dir", str(state_dir), *extra, "--env", "SBX_AGENT_SDK", "--",
                          sys.executable, str(AGENT), "fork", str(free_port_pair()), str(HEAP_MB),
                          "6"], env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    most = 0
    while p.poll() is None:
        most = max(most, int((KSM / "pages_sharing").read_text()) - base)
        try:
            p.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    assert p.returncode == 0, p.stderr.read()
    return most, read_journal(state_dir)


@pytest.mark.alone  # reads and sets the host's KSM counters and settings
@needs_criu
def test_ksm_merges_the_identical_memory_of_live_copies(tmp_path, ksm_running):
    heap_pages = HEAP_MB << 20 >> 12
    # Control: copies not marked mergeable share nothing, though their heaps are identical.
    most, ev = most_pages_sharing(tmp_path / "off", "--set", "resources.ksm=false")
    started = next(e for e in ev if e["type"] == "box.started")
    assert started["capabilities"]["ksm"] == {"host": "running", "copies": False}
    assert {e["ksm"] for e in copies_continue(ev)} == {False}
    assert most < heap_pages // 4, most
    most, ev = most_pages_sharing(tmp_path / "on")
    assert {e["ksm"] for e in copies_continue(ev)} == {True}
    # Four copies of one 32 MiB heap: at least one copy's worth of pages is shared.
    assert most >= heap_pages, most


@needs_criu
def test_a_lazy_pages_daemon_that_fails_leaves_the_copy_eager(tmp_path):
    # criu on PATH is a wrapper whose lazy-pages command fails as a host's seccomp would make it;
    # every other command is the real criu.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "criu"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = lazy-pages ] && {{ echo "Error (test): no uffd" >&2; exit 1; }}\n'
                       f'exec {shutil.which("criu")} "$@"\n')
    wrapper.chmod(0o755)
    ev = fork_box(tmp_path / "s", PATH=f"{bin_dir}:{os.environ['PATH']}")
    for d in copies_continue(ev):
        assert d["lazy"] is False and "lazy-pages daemon did not start" in d["lazy_why"], d
        assert "no uffd" in d["lazy_why"], d  # what the daemon said
    assert not [e for e in ev if e["type"] == "restore.memory_complete"]
