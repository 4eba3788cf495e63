"""Agents that outlive their supervisor: the profile's `checkpoint` section (periodic snapshots
pruned to `keep`, on_stop, on_idle) and the resume from the newest snapshot when a box starts again
on the same state dir, with the real criu of this host (root needed).

The agent (persist_agent.py) prints a counter and a nonce it keeps only in memory: a live resume
goes on with the same nonce from the counter its snapshot froze."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from sbxtest import CLI, INIT, WsBox, mounts_below, of_type, read_events, read_journal, unmount_below, wait_event

AGENT = pathlib.Path(__file__).resolve().parent / "persist_agent.py"

pytestmark = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")


class Box:
    """sandboxer-init on `state`, its events in a file of their own per run."""

    def __init__(self, state, sets, agent_args, run, env=None, relative=False, extra=()):
        """`relative`: the state dir given relative to the supervisor's working directory."""
        self.events = state.parent / f"events-{run}"
        self.proc = subprocess.Popen(
            [str(INIT), "--state-dir", state.name if relative else str(state), "--events", str(self.events),
             *[a for s in sets for a in ("--set", s)], *extra, "--", sys.executable, str(AGENT), *map(str, agent_args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=state.parent)

    def wait(self, pred, timeout=30):
        return wait_event(self.events, pred, timeout)

    def count(self, type_):
        return len(of_type(read_events(self.events), type_))

    def end(self, sig=signal.SIGTERM, timeout=30):
        """Sends `sig` (None: nothing, the box ends by itself) and waits for the exit status."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout)
        return self.proc.returncode

    def stderr(self):
        return self.proc.stderr.read() if self.proc.stderr else ""


def counters(events):
    return [e["message"] for e in events if e["type"] == "proc.message" and "n" in e["message"]]


def own(state):
    return json.loads((state / "persist.json").read_text())["own"]


@pytest.fixture
def state(tmp_path):
    return tmp_path / "state"


def resume_and_stop(state, sets):
    """A second run on `state`: waits for its box.resumed and the agent's next message, then
    TERMs it; returns (box.resumed, the run's stderr)."""
    again = Box(state, sets, [0.1], 2)
    try:
        resumed = again.wait(lambda e: e["type"] == "box.resumed")
        again.wait(lambda e: e["type"] == "proc.message" and e["seq"] > resumed["seq"])
    finally:
        assert again.end() == 143, again.stderr()
    return resumed, again.stderr()


def test_periodic_snapshots_are_pruned_to_keep_and_a_killed_supervisor_resumes(state):
    sets = ["checkpoint.every=1s", "checkpoint.keep=2"]
    # The agent also takes a snapshot named "mine" (its agent channel): never pruned.
    first = Box(state, sets, [0.1], 1, extra=["--env", "PERSIST_NAMED_AT=2"])
    try:
        # Four periodic checkpoints: two kept, the two oldest deleted.
        first.wait(lambda e: e["type"] == "checkpoint.created" and first.count("checkpoint.created") >= 5)
        first.wait(lambda e: e["type"] == "snapshot.deleted" and first.count("snapshot.deleted") >= 2)
    finally:
        assert first.end(signal.SIGKILL) == -signal.SIGKILL
    before = read_journal(state)
    (mine,) = [e["snapshot"] for e in of_type(before, "checkpoint.created") if e["name"] == "mine"]
    created = [e["snapshot"] for e in of_type(before, "checkpoint.created") if e["name"] != "mine"]
    deleted = [e["snapshot"] for e in of_type(before, "snapshot.deleted")]
    assert all(e["name"] in ("periodic", "mine") and e["mode"] == "live" for e in of_type(before, "checkpoint.created"))
    assert deleted == created[:len(deleted)] and len(created) - len(deleted) == 2
    # (Killed right after a prune's event, the record may still list the one it deleted.)
    assert [s for s in own(state) if s not in deleted] == created[-2:]
    assert sorted(p.name[:-5] for p in (state / "snapshots").glob("s-*.json")) == sorted(created[-2:] + [mine])
    newest = created[-1]
    snap_seq = json.loads((state / "snapshots" / f"{newest}.json").read_text())["last_seq"]
    frozen = [m for e in before if e["seq"] <= snap_seq for m in counters([e])][-1]
    last = counters(before)[-1]

    resumed, _ = resume_and_stop(state, sets)
    after = read_journal(state)
    # Every event written before the kill is still there, numbered as it was; the new run goes on
    # after the last seq.
    assert after[:len(before)] == before
    assert [e["seq"] for e in after] == list(range(1, len(after) + 1))
    assert resumed["snapshot"] == newest and resumed["mode"] == "live" and resumed["skipped"] == []
    assert resumed["lost"]["events"] == before[-1]["seq"] - snap_seq and resumed["lost"]["ms"] >= 0
    assert of_type(after[len(before):], "box.started")[0]["resuming"] is True
    # The agent's memory came back: the same nonce, counting on from its snapshot (not from 1).
    # (Lines still in the pipe at the snapshot reach the journal after it: at most up to the kill.)
    later = counters(after[len(before):])
    assert later[0]["nonce"] == last["nonce"] and frozen["n"] < later[0]["n"] <= last["n"] + 1
    assert not of_type(after[len(before):], "proc.started")  # not started again


def test_a_killed_supervisor_under_a_disk_ceiling_resumes(state):
    # Its branch's dir and workspace are tmpfs mounts in the host's mount namespace, left there by
    # the KILL: the next run unmounts them before it sets the ended layer aside and restores.
    sets = ["checkpoint.every=1s", "resources.disk=16M"]
    first = Box(state, sets, [0.1], 1)
    try:
        first.wait(lambda e: e["type"] == "checkpoint.created")
    finally:
        assert first.end(signal.SIGKILL) == -signal.SIGKILL
    try:
        assert len(mounts_below(state)) == 2, mounts_below(state)
        resumed, stderr = resume_and_stop(state, sets)
        assert resumed["mode"] == "live" and resumed["skipped"] == [], resumed
        # Before, the restore went into the earlier run's tmpfs, which stayed mounted for good.
        assert mounts_below(state) == []
        assert "which an earlier run of this box left mounted" in stderr
    finally:
        unmount_below(state)


def test_on_stop_checkpoints_at_sigterm_and_the_next_start_continues_exactly(state):
    sets = ["checkpoint.on_stop=true"]
    # A state dir named relative to the working directory, as people type it (criu works elsewhere).
    first = Box(state, sets, [0.1], 1, relative=True)
    first.wait(lambda e: e["type"] == "proc.message" and e["message"]["n"] >= 5)
    assert first.end() == 0, first.stderr()  # ended by its checkpoint: hibernated, not failed
    before = read_journal(state)
    made = of_type(before, "checkpoint.created")
    assert [(e["name"], e["mode"], e["leave_running"]) for e in made] == [("on_stop", "live", False)]
    assert of_type(before, "proc.exited")[0]["by"] == "checkpoint"
    assert [(e["code"], e["reason"]) for e in of_type(before, "box.exited")] == [(0, "hibernated")]
    last = counters(before)[-1]

    again = Box(state, sets, [0.1], 2, relative=True)
    try:
        resumed = again.wait(lambda e: e["type"] == "box.resumed")
        again.wait(lambda e: e["type"] == "proc.message" and e["seq"] > resumed["seq"])
    finally:
        again.end()
    later = counters(read_journal(state)[len(before):])
    assert resumed["snapshot"] == made[0]["snapshot"] and resumed["lost"]["ms"] >= 0
    # Nothing lost and nothing twice: the agent was ended by the checkpoint itself.
    assert later[0]["nonce"] == last["nonce"] and later[0]["n"] == last["n"] + 1
    assert [m["n"] for m in later] == list(range(later[0]["n"], later[0]["n"] + len(later)))


def test_on_stop_of_a_chatty_agent_journals_each_line_once(state):
    # A line every millisecond. The tree is killed while still stopped after the dump: continued
    # before the kill reached it (as when only its ns-init was killed), the agent wrote a line or
    # two past its snapshot, and the resumed agent wrote them again. (What the stdout pipe holds
    # at the dump is read by this supervisor: criu restores no data into an inherited pipe.)
    sets = ["checkpoint.on_stop=true"]
    first = Box(state, sets, [0.001], 1)
    first.wait(lambda e: e["type"] == "proc.message" and e["message"]["n"] >= 2000)
    assert first.end() == 0, first.stderr()
    before = read_journal(state)
    again = Box(state, sets, [0.001], 2)
    try:
        resumed = again.wait(lambda e: e["type"] == "box.resumed")
        again.wait(lambda e: e["type"] == "proc.message" and e["seq"] > resumed["seq"] + 100)
    finally:
        again.end(signal.SIGKILL)
    numbers = [m["n"] for m in counters(read_journal(state))]
    assert len({m["nonce"] for m in counters(read_journal(state))}) == 1
    repeated = [n for a, n in zip(numbers, numbers[1:]) if n <= a]
    assert not repeated, f"lines journaled twice after the resume: {repeated[:5]}"
    assert numbers == list(range(1, len(numbers) + 1))
    assert len(counters(before)) < len(numbers)


def test_on_stop_without_time_for_the_checkpoint_says_so_and_keeps_the_journal(state):
    # A grace period no checkpoint fits in: the agent is ended without one, and an event says why.
    first = Box(state, ["checkpoint.on_stop=true", "resources.grace=0s"], [0.1], 1)
    first.wait(lambda e: e["type"] == "proc.message" and e["message"]["n"] >= 3)
    first.end()
    events = read_journal(state)
    failed = of_type(events, "persist.failed")
    assert failed and failed[0]["trigger"] == "on_stop" and failed[0]["error"]["code"] == "grace_exceeded"
    assert of_type(events, "proc.exited") and not of_type(events, "checkpoint.created")


def test_on_idle_hibernates_and_the_next_start_wakes_the_agent(state):
    # Three ticks, then 3 s without output; the idle limit (2 s) comes first: it hibernates. The
    # rest of its sleep after the resume is shorter than the limit.
    sets = ["checkpoint.on_idle=true", "resources.idle=2s"]
    first = Box(state, sets, [0.1, 3, 3, 6], 1)
    assert first.end(None, timeout=60) == 0, first.stderr()
    before = read_journal(state)
    hib = of_type(before, "box.hibernated")
    assert len(hib) == 1 and hib[0]["snapshot"] == of_type(before, "checkpoint.created")[0]["snapshot"]
    assert of_type(before, "proc.exited")[0]["by"] == "checkpoint"

    again = Box(state, sets, [0.1, 3, 3, 6], 2)
    assert again.end(None, timeout=60) == 0, again.stderr()
    after = read_journal(state)[len(before):]
    assert of_type(after, "box.resumed")[0]["snapshot"] == hib[0]["snapshot"]
    # The agent woke where it slept and ran to its end: every tick once, one nonce.
    ticks = counters(before) + counters(after)
    assert [m["n"] for m in ticks] == [1, 2, 3, 4, 5, 6] and counters(after)
    assert len({m["nonce"] for m in ticks}) == 1

    # Its work is over: the next start runs the command anew, no older state of it comes back.
    done = len(read_journal(state))
    third = Box(state, sets, [0.1, 0, 0, 2], 3)
    assert third.end(None, timeout=60) == 0, third.stderr()
    fresh = read_journal(state)[done:]
    assert not of_type(fresh, "box.resumed") and "resuming" not in of_type(fresh, "box.started")[0]
    assert [m["n"] for m in counters(fresh)] == [1, 2] and counters(fresh)[0]["nonce"] != ticks[0]["nonce"]


def test_a_corrupted_newest_snapshot_is_found_and_the_previous_one_resumes(state):
    sets = ["checkpoint.every=1s", "checkpoint.keep=3"]
    first = Box(state, sets, [0.1], 1)
    try:
        first.wait(lambda e: e["type"] == "checkpoint.created" and first.count("checkpoint.created") >= 2)
    finally:
        first.end(signal.SIGKILL)
    before = read_journal(state)
    created = [e["snapshot"] for e in of_type(before, "checkpoint.created")]
    newest, previous = created[-1], created[-2]
    # The box's own snapshots are kept in the chunk store: damage a chunk only the newest has.
    snaps = state / "snapshots"
    listed = {s: [c[0] for c in json.loads((snaps / f"{s}.chunks").read_text())["chunks"]] for s in (newest, previous)}
    only_newest = [c for c in listed[newest] if c not in set(listed[previous])]
    assert only_newest and not (snaps / f"{newest}.tar.zst").exists() and not (snaps / f"{newest}.d").exists()
    damaged = only_newest[len(only_newest) // 2]
    chunk = snaps / "chunks" / damaged[:2] / damaged
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))

    again = Box(state, sets, [0.1], 2)
    try:
        resumed = again.wait(lambda e: e["type"] == "box.resumed")
        again.wait(lambda e: e["type"] == "proc.message" and e["seq"] > resumed["seq"])
    finally:
        again.end()
    after = read_journal(state)[len(before):]
    assert resumed["snapshot"] == previous
    assert [s["snapshot"] for s in resumed["skipped"]] == [newest]
    assert "corrupted" in json.dumps(resumed["skipped"][0]["error"])
    assert damaged in json.dumps(resumed["skipped"][0]["error"])
    # Nothing of the corrupted one ran: one restore.done, of the previous snapshot, as main.
    assert [(e["snapshot"], e["branch"]) for e in of_type(after, "restore.done")] == [(previous, "main")]
    assert counters(after)[0]["nonce"] == counters(before)[0]["nonce"]


def test_a_live_snapshot_this_host_cannot_restore_live_resumes_cold_and_says_why(state):
    sets = ["checkpoint.on_stop=true"]
    first = Box(state, sets, [0.1], 1)
    first.wait(lambda e: e["type"] == "proc.message" and e["message"]["n"] >= 3)
    assert first.end() == 0, first.stderr()
    before = read_journal(state)
    # The same box without criu on its PATH: the snapshot's files and the agent's command again.
    no_criu = ":".join(d for d in os.environ["PATH"].split(":") if not (pathlib.Path(d) / "criu").exists())
    again = Box(state, sets, [0.1], 2, env=dict(os.environ, PATH=no_criu))
    try:
        resumed = again.wait(lambda e: e["type"] == "box.resumed")
        again.wait(lambda e: e["type"] == "proc.message" and e["seq"] > resumed["seq"])
    finally:
        again.end()
    assert resumed["mode"] == "cold" and "criu" in resumed["note"] and resumed["skipped"] == []
    later = counters(read_journal(state)[len(before):])
    assert later[0]["n"] == 1 and later[0]["nonce"] != counters(before)[0]["nonce"]


def test_the_checkpoint_section_is_validated_with_the_field_named(tmp_path):
    for setting, words in [("checkpoint.every=100ms", "checkpoint.every: at least 1s"),
                           ("checkpoint.keep=0", "checkpoint.keep: 0 is impossible"),
                           ("checkpoint.on_idle=yes", "checkpoint.on_idle: expected true or false"),
                           ("checkpoint.often=1", "checkpoint.often: unknown field")]:
        r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--set", setting, "--", "true"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 125 and words in r.stderr, (setting, r.stderr)
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--set", "resources.snapshots=3", "--set",
                        "checkpoint={\"every\": \"1m\", \"keep\": 3}", "--", "true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and "checkpoint.keep: 3 snapshots do not fit in resources.snapshots (3)" in r.stderr


def test_a_copy_made_in_an_idle_box_resumes_itself_when_started_idle_again(tmp_path):
    # `fork --host docker` makes each copy in a container started `--idle` (restore with an index);
    # a crash restarts that container with the same command line. A persisting copy must come back
    # as itself (its own newest snapshot), not as an empty idle box.
    sets = ["--set", "checkpoint.every=1s", "--set", "checkpoint.keep=2", "--set", "resources.grace=1s"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    archive = tmp_path / "a.tar.zst"

    def cli(box, *args):
        r = subprocess.run([str(CLI), *args, "--token-file", str(box.token_file)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().splitlines()

    with WsBox(tmp_path / "a", [sys.executable, str(AGENT), "0.1"], extra=sets) as a:
        a_nonce = wait_event(a.events, lambda e: e["type"] == "proc.message")["message"]["nonce"]
        snap = cli(a, "checkpoint", a.url)[-1]
        cli(a, "export", a.url, snap, str(archive))
    b = WsBox(tmp_path / "b", [], extra=["--idle", *sets])
    try:
        cli(b, "import", b.url, str(archive))
        cli(b, "restore", b.url, snap, "--index", "0")
        # The copy checkpoints itself (its own box's snapshots), then the box is killed.
        wait_event(b.events, lambda e: e["type"] == "checkpoint.created" and e.get("name") == "periodic")
    finally:
        b.proc.kill()
        b.proc.wait(30)
    before = read_journal(b.state)
    assert counters(before)[-1]["nonce"] == a_nonce
    again = subprocess.Popen([str(INIT), "--state-dir", str(b.state), "--events", str(tmp_path / "events-2"),
                              *sets, "--idle", "--"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        resumed = wait_event(tmp_path / "events-2", lambda e: e["type"] == "box.resumed")
        wait_event(tmp_path / "events-2", lambda e: e["type"] == "proc.message" and e["seq"] > resumed["seq"])
    finally:
        again.terminate()
        again.wait(30)
    assert resumed["snapshot"] != snap and resumed["mode"] == "live", resumed
    later = counters(read_journal(b.state)[len(before):])
    assert later and later[0]["nonce"] == a_nonce, later[:2]
