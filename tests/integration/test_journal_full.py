"""The journal when the disk fills (issue 16): written before shown holds on a full disk.

The state dir is a small tmpfs the test mounts, most of it taken by a ballast file, and the agent
writes more than the rest can hold. Before this was handled, the journal stopped with ENOSPC on
stderr while live clients and `--events` went on: events shown that no journal held. Now the
journal cuts back to its last whole line, says `journal.degraded` (in space a reserve gives back),
keeps what follows in memory unseen, freezes the agent once that passes `journal.queue`, and when
the test frees the ballast writes it all in order, thaws the agent and says `journal.recovered`.
"""
import asyncio
import datetime
import json
import os
import pathlib
import signal
import subprocess
import time

import pytest
from websockets.exceptions import ConnectionClosed

from sbxtest import INIT, PROBE, WsBox, read_journal, run, ws_connect

TMPFS = 8 << 20
BALLAST = 7 << 20
SPEW = 3_000_000  # bytes of agent stdout: far more than the tmpfs has left


def freezer_state(pid):
    """The freezer state of `pid`'s v1 freezer cgroup ("" when it has none)."""
    for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            return pathlib.Path(f"/sys/fs/cgroup/freezer{path}/freezer.state").read_text().strip()
    return ""


@pytest.fixture
def small_state(tmp_path):
    if not pathlib.Path("/sys/fs/cgroup/freezer").is_dir():
        pytest.skip("no v1 freezer hierarchy on this host")
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS},mode=0755", "tmpfs", str(state)], check=True)
    try:
        (state / "ballast").write_bytes(b"\0" * BALLAST)
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def journal_lines(state):
    """The raw lines of the journal's plain segments (nothing is sealed at these sizes)."""
    lines = []
    for f in sorted((state / "journal").glob("*.jsonl")):
        lines += [json.loads(l) for l in f.read_text().splitlines()]
    return lines


def test_a_full_disk_loses_nothing_and_shows_nothing_unwritten(tmp_path, small_state):
    with WsBox(tmp_path, [str(PROBE), "spew", str(SPEW)],
               extra=["--set", "journal.queue=256KiB"]) as box:
        seen = []

        async def watch():
            async with ws_connect(box) as ws:
                await ws.send(json.dumps({"id": 1, "op": "subscribe", "since": 0}))

                async def read_all():  # every event, until the box's close
                    try:
                        while True:
                            m = json.loads(await ws.recv())
                            if "seq" in m and "id" not in m:
                                seen.append(m)
                    except ConnectionClosed:
                        pass

                async def until(pred, timeout=30):
                    deadline = time.monotonic() + timeout
                    while not (hit := next((e for e in seen if pred(e)), None)):
                        assert time.monotonic() < deadline, "event not seen"
                        await asyncio.sleep(0.02)
                    return hit

                reader = asyncio.create_task(read_all())
                started = await until(lambda e: e["type"] == "proc.started")
                await until(lambda e: e["type"] == "journal.degraded")
                # The queue passes its bound and the agent's tree is frozen, not killed.
                deadline = time.monotonic() + 30
                while freezer_state(started["pid"]) != "FROZEN":
                    assert time.monotonic() < deadline, "the agent was never frozen"
                    await asyncio.sleep(0.05)
                shown = len(seen)
                await asyncio.sleep(0.5)
                # Frozen, and nothing the disk has not taken is shown meanwhile.
                assert freezer_state(started["pid"]) == "FROZEN"
                assert len(seen) == shown
                (small_state / "ballast").unlink()  # space comes back
                await asyncio.wait_for(reader, 60)

        run(watch(), timeout=120)
        assert box.proc.wait(60) == 0, box.stderr()

    on_disk = journal_lines(small_state)
    disk_seqs = [e["seq"] for e in on_disk]
    # Every seq once, in order, no gap.
    assert disk_seqs == list(range(1, len(disk_seqs) + 1))
    # Written before shown: every event a client saw is the journal's event of that seq.
    by_seq = {e["seq"]: e for e in on_disk}
    for e in seen:
        assert e["seq"] in by_seq, f"shown but not in the journal: {e['seq']} {e['type']}"
        assert by_seq[e["seq"]]["type"] == e["type"]
    # ... and the client saw the journal up to the agent's end.
    assert [e["seq"] for e in seen] == disk_seqs[:len(seen)]
    # The agent's whole output, byte for byte, in order.
    out = "".join(e["data"] for e in on_disk if e["type"] == "proc.output" and e["stream"] == "stdout")
    assert len(out) == SPEW
    assert out.splitlines()[:3] == [f"{i:010d} abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" for i in range(3)]
    degraded = [e for e in on_disk if e["type"] == "journal.degraded"]
    recovered = [e for e in on_disk if e["type"] == "journal.recovered"]
    assert len(degraded) == 1 and degraded[0]["reason"] == "No space left on device"
    assert len(recovered) == 1 and recovered[0]["after"] == "degraded"
    assert recovered[0]["events"] > 0 and recovered[0]["bytes"] > 256 << 10
    assert recovered[0]["agent_stopped"] is True
    # Every event has a branch, the journal's own too (they had none).
    assert degraded[0]["branch"] == recovered[0]["branch"] == "main"
    exited = [e for e in on_disk if e["type"] == "proc.exited"]
    assert exited and exited[-1]["code"] == 0
    # The same through the user's reader.
    assert [e["seq"] for e in read_journal(small_state)] == disk_seqs


def test_a_restart_never_reuses_a_seq_that_waited_in_memory(tmp_path, small_state):
    """A box killed while events wait for the disk: the next run numbers after them."""
    box = WsBox(tmp_path, [str(PROBE), "spew", str(SPEW)], extra=["--set", "journal.queue=256KiB"], as_pid1=True)
    try:
        box.wait_event(lambda e: e["type"] == "journal.degraded", timeout=30)
        hwm_file = small_state / "journal" / "seq.hwm"
        deadline = time.monotonic() + 30
        while int(hwm_file.read_text() or 0) <= box.read_events()[-1]["seq"]:
            assert time.monotonic() < deadline, "no seq was handed out to a waiting event"
            time.sleep(0.05)
    finally:
        os.killpg(box.proc.pid, signal.SIGKILL)  # no goodbye: what waited in memory is gone
        box.stop()
    hwm = int((small_state / "journal" / "seq.hwm").read_text())
    last_on_disk = journal_lines(small_state)[-1]["seq"]
    assert hwm > last_on_disk
    (small_state / "ballast").unlink()
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(small_state),
                        "--", "/bin/true"], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    after = [e for e in journal_lines(small_state) if e["seq"] > last_on_disk]
    # Numbering goes on after every seq the killed run handed out, shown or not.
    assert after and after[0]["seq"] == hwm + 1


def test_a_box_that_ends_while_events_wait_for_the_disk_says_so_once_and_ends_as_its_agent(small_state):
    """The agent writes past the full disk and exits while the journal is still degraded: the box
    exits with the agent's status, says once which events never reached the disk, and closes the
    journal's retry timer while its loop still turns (scripts/sanitize runs this file against
    build-asan, whose leak check found that timer, and the loop's own memory, left at exit: the
    box then exited 86 instead of its agent's 0)."""
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(small_state / "s"),
                        "--set", "journal.queue=64MiB", "--", str(PROBE), "spew", str(SPEW)],
                       capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert err.count("never reached the disk, which stayed full") == 1, err
    assert "LeakSanitizer" not in err, err


def test_the_timeout_clock_stands_still_while_the_agent_is_frozen_for_the_journal(tmp_path, small_state):
    """Frozen for a full disk longer than its whole timeout, the agent is not ended for it: it was
    not let run. Thawed when space returns, it finishes its output and exits by itself. Without
    the pause the timeout fires while it is frozen and it ends as "timeout"."""
    sets = ["journal.queue=256KiB", "resources.timeout=3s", "resources.grace=1s"]
    with WsBox(tmp_path, [str(PROBE), "spew", str(SPEW)], extra=[a for s in sets for a in ("--set", s)]) as box:
        started = box.wait_event(lambda e: e["type"] == "proc.started", timeout=30)
        deadline = time.monotonic() + 30
        while freezer_state(started["pid"]) != "FROZEN":
            assert time.monotonic() < deadline, "the agent was never frozen"
            time.sleep(0.05)
        time.sleep(4)  # frozen past the 3 s timeout
        assert freezer_state(started["pid"]) == "FROZEN"
        (small_state / "ballast").unlink()
        assert box.proc.wait(60) == 0, box.stderr()
    exited = [e for e in journal_lines(small_state) if e["type"] == "proc.exited" and e.get("proc") == "main"]
    assert exited and exited[-1]["reason"] == "exited" and exited[-1]["code"] == 0, exited
    out = "".join(e["data"] for e in journal_lines(small_state) if e["type"] == "proc.output" and e["stream"] == "stdout")
    assert len(out) == SPEW


def test_without_a_freezer_the_agents_output_waits_unread(tmp_path, small_state):
    """A box without cgroups (SANDBOXER_CGROUP=none, as a container whose cgroup filesystem is
    read-only) cannot freeze its agent for a full disk: it stops reading the agent's output
    instead, so the agent blocks in its next write and what waits in memory stays bounded. When
    space returns everything is written, in order. Without the pause (the control this replaced)
    the agent was never blocked: its 3 MB went into memory and it exited."""
    env = dict(os.environ, SANDBOXER_CGROUP="none")
    with WsBox(tmp_path, [str(PROBE), "spew", str(SPEW)], extra=["--set", "journal.queue=256KiB"], env=env) as box:
        started = box.wait_event(lambda e: e["type"] == "proc.started", timeout=30)
        box.wait_event(lambda e: e["type"] == "journal.degraded", timeout=30)
        def wchan():
            try:
                return pathlib.Path(f"/proc/{started['pid']}/wchan").read_text()
            except FileNotFoundError:
                return "(ended)"
        deadline = time.monotonic() + 30
        while "pipe_write" not in (w := wchan()):
            assert time.monotonic() < deadline and w != "(ended)", f"the agent was never blocked in a write: {w}"
            time.sleep(0.05)
        time.sleep(0.5)
        assert "pipe_write" in wchan()  # still waiting: its output is not read
        assert "its output is not read until the journal is written" in box.stderr()
        (small_state / "ballast").unlink()
        assert box.proc.wait(60) == 0, box.stderr()
    on_disk = journal_lines(small_state)
    assert [e["seq"] for e in on_disk] == list(range(1, len(on_disk) + 1))
    out = "".join(e["data"] for e in on_disk if e["type"] == "proc.output" and e["stream"] == "stdout")
    assert len(out) == SPEW
    recovered = [e for e in on_disk if e["type"] == "journal.recovered"]
    assert len(recovered) == 1 and recovered[0]["agent_stopped"] is True, recovered
    # Bounded: what waited in memory is about the queue's bound, not the agent's 3 MB.
    assert recovered[0]["bytes"] < 1 << 20, recovered


CHANNEL_AGENT = r'''
import os, sys, threading
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ch = agent.Channel()
def spew():
    line = b"x" * 99 + b"\n"
    for _ in range(30000):
        os.write(1, line)
threading.Thread(target=spew).start()
i = 0
while not os.path.exists("/workspace/stop"):
    ch.event("agent.note", i=i)
    i += 1
'''


def test_without_a_freezer_the_agents_channel_waits_unread_too(tmp_path, small_state):
    """As above, with an agent that also writes events through its channel in a loop while another
    thread fills its stdout: once the box stops reading, both wait (the channel's next reply never
    comes), and no agent event is taken while they do. Without the channel's pause (its control)
    the loop went on and its events were stamped all through the wait."""
    sdk = pathlib.Path(__file__).resolve().parents[2] / "sdk" / "python" / "sandboxer"
    env = dict(os.environ, SANDBOXER_CGROUP="none", SBX_AGENT_SDK=str(sdk))
    with WsBox(tmp_path, ["python3", "-c", CHANNEL_AGENT],
               extra=["--set", "journal.queue=256KiB", "--env", "SBX_AGENT_SDK"], env=env) as box:
        started = box.wait_event(lambda e: e["type"] == "proc.started", timeout=30)
        box.wait_event(lambda e: e["type"] == "journal.degraded", timeout=30)

        def waits():
            out = []
            for t in pathlib.Path(f"/proc/{started['pid']}/task").iterdir():
                try:
                    out.append((t / "wchan").read_text())
                except FileNotFoundError:
                    pass
            return out
        deadline = time.monotonic() + 30
        while not (any("pipe_write" in w for w in waits()) and any("pipe_read" in w for w in waits())):
            assert time.monotonic() < deadline, f"the agent's threads never both waited: {waits()}"
            time.sleep(0.05)
        t_blocked = time.time()
        time.sleep(1.0)
        t_free = time.time()
        (small_state / "ballast").unlink()
        (small_state / "branches" / "main" / "workspace" / "stop").write_text("")
        assert box.proc.wait(60) == 0, box.stderr()
    notes = [e for e in journal_lines(small_state) if e["type"] == "agent.note"]
    assert notes, "the agent wrote no event"
    stamped = [e for e in notes
               if t_blocked + 0.1 < datetime.datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp() < t_free]
    assert stamped == [], f"{len(stamped)} channel events were taken while the box waited for the disk"
