"""checkpoint{hold_ms} and checkpoint.release (what `migrate` stands on, issue 17): after its
snapshot the agent stays stopped, neither continued nor ended, until it is released to go on
(a move that failed) or to end (its copy runs elsewhere), or until the hold runs out."""
import asyncio
import shutil
import time

import pytest

from sbxtest import Session, WsBox, output_of, ws_connect

pytestmark = pytest.mark.skipif(shutil.which("criu") is None, reason="needs criu on PATH")

COUNTER = ("import time\n"
           "n = 0\n"
           "while True:\n"
           "    n += 1\n"
           "    print(n, flush=True)\n"
           "    time.sleep(0.05)\n")


def numbers(box):
    text = output_of(box.read_events(), "main").decode(errors="replace")
    return [int(x) for x in text[:text.rfind("\n") + 1].split()]


def request(box, op, **fields):
    async def go():
        async with ws_connect(box) as ws:
            return await Session(ws).request(op, timeout=60, **fields)
    return asyncio.run(go())


def events_of(box, type_):
    return [e for e in box.read_events() if e["type"] == type_]


def test_a_held_agent_stays_stopped_until_released_to_go_on(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(0.6)
        r = request(box, "checkpoint", hold_ms=60000)
        assert r["ok"] and r["held"] is True, r
        held_at = max(numbers(box))
        time.sleep(0.6)
        # Stopped: not one more line in 0.6 s (it prints one every 0.05 s when it runs).
        assert max(numbers(box)) <= held_at + 1
        (created,) = events_of(box, "checkpoint.created")
        assert created["held"] is True and created["snapshot"] == r["snapshot"]
        # Held, the branch takes no other checkpoint.
        busy = request(box, "checkpoint")
        assert not busy["ok"] and busy["error"]["code"] == "busy", busy
        rel = request(box, "checkpoint.release", end=False)
        assert rel == {"id": rel["id"], "ok": True, "action": "continued"}, rel
        time.sleep(0.5)
        # Control: released, it counts on from where it stopped (its memory kept, not restarted).
        after = numbers(box)
        assert max(after) > held_at + 3 and after == list(range(1, len(after) + 1))
        (released,) = events_of(box, "checkpoint.released")
        assert (released["action"], released["snapshot"]) == ("continued", r["snapshot"])
        again = request(box, "checkpoint.release", end=False)
        assert not again["ok"] and again["error"]["code"] == "not_held", again
        assert box.alive()


def test_a_held_agent_released_to_end_ends_the_box_and_one_never_released_goes_on(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with WsBox(tmp_path / "a", ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(0.4)
        bad = request(box, "checkpoint", hold_ms=1000, leave_running=False)
        assert not bad["ok"] and "exclude each other" in bad["error"]["message"], bad
        r = request(box, "checkpoint", hold_ms=60000)
        assert r["ok"], r
        rel = request(box, "checkpoint.release", end=True)
        assert rel["ok"] and rel["action"] == "ended", rel
        # Ended by its checkpoint, as `checkpoint --stop` ends it: the box ends with it, status 0.
        assert box.proc.wait(timeout=30) == 0
        exited = [e for e in box.read_events() if e["type"] == "proc.exited" and e.get("proc") == "main"]
        assert exited and exited[-1].get("by") == "checkpoint", exited
    with WsBox(tmp_path / "b", ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(0.4)
        assert request(box, "checkpoint", hold_ms=800)["ok"]
        held_at = max(numbers(box))
        deadline = time.monotonic() + 10
        while not events_of(box, "checkpoint.released") and time.monotonic() < deadline:
            time.sleep(0.1)
        (released,) = events_of(box, "checkpoint.released")
        assert released["action"] == "continued" and "within its hold" in released["why"], released
        time.sleep(0.4)
        assert max(numbers(box)) > held_at + 2 and box.alive()


def test_a_hold_released_early_does_not_cut_short_the_next_hold_of_the_branch(tmp_path):
    # The first hold's 1.5 s run out while the second (60 s) holds the same branch: that end is
    # the first hold's, and the second stays held until it is released.
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(0.4)
        assert request(box, "checkpoint", hold_ms=1500)["ok"]
        assert request(box, "checkpoint.release", end=False)["action"] == "continued"
        assert request(box, "checkpoint", hold_ms=60000)["ok"]
        held_at = max(numbers(box))
        time.sleep(2.5)
        assert len(events_of(box, "checkpoint.released")) == 1
        assert max(numbers(box)) <= held_at + 1
        rel = request(box, "checkpoint.release", end=False)
        assert rel["ok"] and rel["action"] == "continued", rel
        assert box.alive()


def test_a_hold_is_refused_where_the_snapshot_would_be_files_only(tmp_path):
    # Ended once its copy runs, a held agent whose snapshot has no memory would be lost: a branch
    # without namespaces of its own (files-only snapshots) is refused a hold, and goes on.
    with WsBox(tmp_path, ["python3", "-c", COUNTER],
               extra=["--set", "resources.grace=1s", "--set", "isolation.namespaces=false"]) as box:
        time.sleep(0.4)
        r = request(box, "checkpoint", hold_ms=60000)
        assert not r["ok"] and r["error"]["code"] == "not_live", r
        assert "filesystem only" in r["error"]["message"], r
        n = max(numbers(box))
        time.sleep(0.3)
        assert max(numbers(box)) > n and not events_of(box, "checkpoint.created")
        # Control: the same branch takes a plain (files-only) checkpoint.
        plain = request(box, "checkpoint")
        assert plain["ok"] and plain["mode"] == "fs", plain


@pytest.mark.parametrize("limit", ["timeout", "idle"])
def test_the_timeout_and_idle_clocks_stand_still_while_the_agent_is_held(tmp_path, limit):
    """A hold longer than the agent's timeout (or idle limit) does not end it: it was not let run.
    Released, it goes on (a counter counts on; a silent agent is still there), and its clock then
    runs out as it would have, ending it for that reason. Without the pause the limit fires while
    it is held, and the release finds it gone."""
    if limit == "timeout":
        argv, sets = ["python3", "-c", COUNTER], ["resources.timeout=3s"]
    else:
        argv, sets = ["sleep", "600"], ["resources.idle=3s"]
    with WsBox(tmp_path, argv, extra=[a for s in ["resources.grace=1s", *sets] for a in ("--set", s)]) as box:
        time.sleep(0.5)
        assert request(box, "checkpoint", hold_ms=60000)["ok"]
        time.sleep(4.5)  # held past the 3 s limit
        assert not [e for e in events_of(box, "proc.exited") if e.get("proc") == "main"]
        rel = request(box, "checkpoint.release", end=False)
        assert rel["ok"] and rel["action"] == "continued", rel
        at = max(numbers(box)) if limit == "timeout" else 0
        time.sleep(0.5)
        # Still there 0.5 s after the release (its clock stood at 0.5 s of 3), and counting.
        assert not [e for e in events_of(box, "proc.exited") if e.get("proc") == "main"]
        if limit == "timeout":
            assert max(numbers(box)) > at + 3
        exited = box.wait_event(lambda e: e["type"] == "proc.exited" and e.get("proc") == "main", timeout=30)
        assert exited["reason"] == limit, exited


def test_an_archive_that_is_not_its_snapshots_is_refused_and_nothing_of_it_is_kept(tmp_path):
    """The id is the manifest's hash, checked as the archive is extracted: a snapshot's archive
    replaced by another valid, signed one of the same box (it extracts cleanly) is refused at
    restore, and its extraction is not kept. The control: the same restore of the untouched
    snapshot runs."""
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(0.3)
        a = request(box, "checkpoint")["snapshot"]
        time.sleep(0.3)
        b = request(box, "checkpoint")["snapshot"]
        snaps = box.state / "snapshots"
        # Both extracted dirs go (restores of B must extract it too), A's archive becomes B's.
        shutil.rmtree(snaps / f"{a}.d")
        shutil.rmtree(snaps / f"{b}.d")
        shutil.copyfile(snaps / f"{b}.tar.zst", snaps / f"{a}.tar.zst")
        r = request(box, "restore", snapshot=a)
        assert not r["ok"] and r["error"]["code"] == "bad_snapshot", r
        assert f"the manifest of {a} is corrupted: its sha256 is {b[2:]}" in r["error"]["message"], r
        assert not list(snaps.glob(f"{a}.d*")), list(snaps.iterdir())
        ok = request(box, "restore", snapshot=b)
        assert ok["ok"] and ok["copies"][0]["mode"] == "live", ok
