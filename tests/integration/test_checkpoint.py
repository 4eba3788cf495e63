"""Checkpoint, restore and fork of live agents with the real criu of this host (root needed).

The agent (live_agent.py) checkpoints or forks itself through the agent channel at a decision
point; restores into a new box go through `sandboxer-init --restore FILE`."""
import asyncio
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from sbxtest import (INIT, LEASE_AGENT, ROOT, Session, WsBox, free_port_pair, mounts_below, read_journal, run,
                     unmount_below, wait_for_path, ws_connect)

AGENT = pathlib.Path(__file__).resolve().parent / "live_agent.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"

needs_criu = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")


def env(**extra):
    e = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    e.update(extra)
    return e


def port():
    return free_port_pair()


def box(state_dir, args, *, timeout=120, environ=None):
    """Runs one box to its end; returns (returncode, events of its journal, stderr)."""
    # The agent's environment is clean: the SDK's path reaches it by name (--env).
    r = subprocess.run([str(INIT), "--state-dir", str(state_dir), "--env", "SBX_AGENT_SDK", *args],
                       capture_output=True, timeout=timeout,
                       env=environ or env(), text=True)
    events = read_journal(state_dir)
    return r.returncode, events, r.stderr + why_in_journal(events)


def why_in_journal(events):
    """What the journal says went wrong, for a failed assertion's message: every agent's stderr
    (an agent's traceback lands there, not on the box's stderr) and the failure events."""
    lines = []
    for e in events:
        if e["type"] == "proc.output" and e.get("stream") == "stderr":
            lines.append(f"[{e.get('branch')} {e.get('proc')}] {e.get('data', '<binary>')}".rstrip())
        elif e["type"].endswith(".failed") or e["type"] == "proc.exited" and e.get("status", 0) != 0:
            lines.append(json.dumps(e))
    return "\n--- from the journal ---\n" + "\n".join(lines) if lines else ""


def agent_box(state_dir, mode, heap_mb, linger=0.0, *extra, **kw):
    return box(state_dir, [*extra, "--", sys.executable, str(AGENT), mode, str(kw.pop("p", port())), str(heap_mb),
                           str(linger)], **kw)


def messages(events, branch=None):
    return [e["message"] for e in events
            if e["type"] == "proc.message" and (branch is None or e["branch"] == branch)]


def one(events, type_):
    found = [e for e in events if e["type"] == type_]
    assert len(found) == 1, (type_, found)
    return found[0]


@needs_criu
def test_a_live_restore_where_a_masked_path_of_the_original_is_gone_says_which(tmp_path):
    """The original's key directory ($XDG_STATE_HOME/sandboxer) is masked from its agent; a live
    copy mounts that mask again and needs the path. Where it is gone, the restore is refused
    naming it (criu's own log ended in an unrelated /dev/net/tun error). The control: the same
    archive restores live once it is back. (Masks under /tmp are made in the copy's own /tmp.)"""
    xa = pathlib.Path(tempfile.mkdtemp(prefix="sbx-test-xdg-", dir="/var/tmp"))
    try:
        rc, ev1, err = agent_box(tmp_path / "a", "restore", 20, environ=env(XDG_STATE_HOME=str(xa)))
        assert rc == 137, err
        created = one(ev1, "checkpoint.created")
        key = tmp_path / "key.pem"
        shutil.copy(xa / "sandboxer" / "keys" / "signing.pem", key)
        archive = tmp_path / "moved.tar.zst"
        shutil.copy(created["archive"], archive)
        gone = xa.with_name(xa.name + "-gone")
        xa.rename(gone)
        other = env(XDG_STATE_HOME=str(tmp_path / "xb"))
        rc, ev2, err = box(tmp_path / "b", ["--trust-key", str(key), "--restore", str(archive)], environ=other)
        assert rc != 0
        failed = one(ev2, "restore.failed")
        assert f"the snapshot's masked path {xa}/sandboxer" in failed["error"], failed
        assert "is not here (No such file or directory)" in failed["error"] and "tun" not in failed["error"], failed
        gone.rename(xa)
        rc, ev3, err = box(tmp_path / "c", ["--trust-key", str(key), "--restore", str(archive)], environ=other)
        assert rc == 0, err
        assert one(ev3, "restore.done")["mode"] == "live"
    finally:
        shutil.rmtree(xa, ignore_errors=True)
        shutil.rmtree(xa.with_name(xa.name + "-gone"), ignore_errors=True)


@needs_criu
def test_a_restored_agent_continues_with_the_same_memory(tmp_path):
    rc, ev1, err = agent_box(tmp_path / "a", "restore", 200)
    assert rc == 137, err  # the original ends at its checkpoint (KILL), as asked
    start = next(m for m in messages(ev1) if m.get("start"))
    assert [m["n"] for m in messages(ev1) if "n" in m and not m.get("after")] == [1, 2, 3]
    assert not any(m.get("after") for m in messages(ev1))
    created = one(ev1, "checkpoint.created")
    assert created["mode"] == "live" and created["sizes"]["images"] > 200 << 20
    for k in ("dump", "snapshot", "freeze", "compress", "total"):
        assert created["timings_ms"][k] >= 0
    ended = one(ev1, "proc.exited")
    assert ended["reason"] == "killed" and ended["by"] == "checkpoint"

    rc, ev2, err = box(tmp_path / "b", ["--restore", created["archive"]])
    assert rc == 0, err
    done = one(ev2, "restore.done")
    assert done["mode"] == "live" and done["snapshot"] == created["snapshot"] and done["branch"] == "main"
    # The restored box continues the parent's numbering after the archive's last seq.
    index = json.loads((tmp_path / "a" / "snapshots" / f"{created['snapshot']}.json").read_text())
    assert index["last_seq"] > 3 and done["seq"] > index["last_seq"]
    assert ev2[0]["type"] == "restore.done" and ev2[1]["type"] == "box.started"
    after = [m for m in messages(ev2) if m.get("after")]
    assert len(after) == 1, ev2
    a = after[0]
    # Same counter, same nonce (never on disk), same 200 MB of heap; the listener and the open
    # file work: a cold restart cannot pass this.
    assert a["n"] == 4 and a["copy"] is True
    assert a["nonce"] == start["nonce"] and a["sum"] == start["sum"]
    assert a["ping"] == "ping" and a["counter"] == ["1", "2", "3", "4"]
    assert a["branch_json"]["mode"] == "live" and a["branch_json"]["snapshot"] == created["snapshot"]


@needs_criu
def test_fork_of_four_runs_four_live_copies_side_by_side(tmp_path):
    p = port()
    rc, ev, err = agent_box(tmp_path / "s", "fork", 16, 1.5, p=p)
    assert rc == 0, err
    start = next(m for m in messages(ev) if m.get("start"))
    done = [e for e in ev if e["type"] == "restore.done"]
    assert len(done) == 4 and {e["mode"] for e in done} == {"live"}
    copies = sorted(e["branch"] for e in done)
    assert len(set(copies)) == 4 and "main" not in copies
    fork = one(ev, "fork.created")
    assert fork["n"] == 4 and sorted(c["branch"] for c in fork["copies"]) == copies
    after = {m["branch"]: m for m in messages(ev) if m.get("after")}
    assert sorted(after) == sorted(copies + ["main"]), after
    for b in copies:
        a = after[b]
        assert a["copy"] is True and a["n"] == 4
        assert a["nonce"] == start["nonce"] and a["sum"] == start["sum"]
        assert a["ping"] == "ping"  # its own restored listener, in its own network namespace
        assert a["bound"] is True  # the same fresh port in every copy
        assert a["others"] == []  # its own files only
        assert a["before"] == start["nonce"]  # the file written just before the checkpoint
        assert a["counter"] == ["1", "2", "3", "4"]
        assert a["branch_json"]["branch"] == b and a["branch_json"]["mode"] == "live"
    assert after["main"]["copy"] is False and after["main"]["bound"] is True
    # A TCP connection open at the checkpoint stays with the original and is closed in copies.
    assert after["main"]["tcp"] == "open" and {after[b]["tcp"] for b in copies} == {"closed"}
    # Each copy has its own network namespace, UTS namespace (hostname) and time namespace.
    for key in ("netns", "hostname", "clocks"):
        assert len({after[b][key] for b in copies + ["main"]}) == 5, (key, [after[b][key] for b in after])
    assert all(after[b]["hostname"].startswith(b + ".") for b in copies)
    # All four ran at once: every copy reported before any of them ended.
    last_after = max(e["seq"] for e in ev if e["type"] == "proc.message" and e["message"].get("after")
                     and e["branch"] != "main")
    first_exit = min(e["seq"] for e in ev if e["type"] == "proc.exited" and e["branch"] != "main")
    assert last_after < first_exit
    for b in copies:
        ws = tmp_path / "s" / "branches" / b / "workspace"
        assert sorted(x.name for x in ws.iterdir() if x.name.startswith("mine-")) == [f"mine-{b}.txt"]


@needs_criu
def test_leave_running_keeps_the_original_going(tmp_path):
    rc, ev, err = agent_box(tmp_path / "s", "keep", 8)
    assert rc == 0, err
    created = one(ev, "checkpoint.created")
    assert created["leave_running"] is True and created["mode"] == "live"
    after = [m for m in messages(ev) if m.get("after")]
    assert len(after) == 1 and after[0]["copy"] is False and after[0]["n"] == 4
    assert one(ev, "proc.exited")["reason"] == "exited"


@needs_criu
def test_a_corrupted_or_truncated_archive_is_refused(tmp_path):
    rc, ev, err = agent_box(tmp_path / "a", "keep", 4)
    assert rc == 0, err
    archive = pathlib.Path(one(ev, "checkpoint.created")["archive"])
    data = archive.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (tmp_path / "flipped.tar.zst").write_bytes(bytes(flipped))
    (tmp_path / "truncated.tar.zst").write_bytes(data[:len(data) // 2])
    for name in ("flipped", "truncated"):
        rc, ev2, err = box(tmp_path / name, ["--restore", str(tmp_path / f"{name}.tar.zst")])
        assert rc == 125, err
        failed = one(ev2, "restore.failed")
        assert "corrupted" in failed["error"] or "truncated" in failed["error"], failed
        assert not any(e["type"] == "restore.done" for e in ev2)
        assert not (tmp_path / name / "branches" / "main").exists()  # nothing half-restored
    # Control: the intact archive restores.
    rc, ev3, err = box(tmp_path / "intact", ["--restore", str(archive)])
    assert rc == 0, err
    assert one(ev3, "restore.done")["mode"] == "live"


BIG_FILE_THEN_CHECKPOINT = r'''
import os, sys
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
with open(os.path.join(os.environ["SANDBOXER_WORKSPACE"], "big"), "wb") as f:
    f.write(b"x" * (3 << 20))
agent.Channel().checkpoint("big")
'''


def test_a_copy_that_fails_under_a_disk_ceiling_leaves_nothing_mounted(tmp_path):
    """Under a disk ceiling a copy's dir and workspace are tmpfs mounts made before the snapshot's
    files are copied in; a copy that then fails (here: a 3 MiB file does not fit under the new
    box's 1M ceiling) removes its dir with both mounts. Before, the dir's own tmpfs stayed
    mounted in the host's mount namespace after the box had ended."""
    rc, ev1, err = box(tmp_path / "a", ["--", sys.executable, "-c", BIG_FILE_THEN_CHECKPOINT])
    assert rc == 0, err
    archive = one(ev1, "checkpoint.created")["archive"]
    state = tmp_path / "b"
    try:
        rc, ev2, err = box(state, ["--set", "resources.disk=1M", "--restore", archive])
        assert rc != 0 and "No space left on device" in one(ev2, "restore.failed")["error"], err
        assert mounts_below(state) == [], mounts_below(state)
        assert not (state / "branches" / "main").exists()
        # Control: under a ceiling the file fits in, the same archive restores.
        rc, ev3, err = box(tmp_path / "c", ["--set", "resources.disk=8M", "--restore", archive])
        assert rc == 0 and one(ev3, "restore.done"), err
    finally:
        unmount_below(tmp_path)


def test_a_restore_from_a_file_that_changes_while_it_is_read_is_refused(tmp_path):
    # --restore extracts the operator's file while it links or copies it into the store: a file
    # that changes meanwhile (here its times, every half millisecond) could give an extraction and
    # a stored archive that differ, so the restore is refused and keeps nothing.
    rc, ev, err = agent_box(tmp_path / "a", "keep", 4)
    assert rc == 0, err
    src = tmp_path / "moving.tar.zst"
    shutil.copy(one(ev, "checkpoint.created")["archive"], src)
    stop = threading.Event()

    def touch():
        while not stop.is_set():
            os.utime(src)
            time.sleep(0.0005)
    t = threading.Thread(target=touch)
    t.start()
    try:
        rc, ev2, err = box(tmp_path / "moving", ["--restore", str(src)])
    finally:
        stop.set()
        t.join()
    assert rc == 125, err
    assert "changed while it was read" in one(ev2, "restore.failed")["error"]
    assert not (tmp_path / "moving" / "branches" / "main").exists()
    assert not list((tmp_path / "moving" / "snapshots").glob("s-*")), "nothing is filed"
    # Control: the same file, left alone, restores.
    rc, ev3, err = box(tmp_path / "still", ["--restore", str(src)])
    assert rc == 0, err
    assert one(ev3, "restore.done")["mode"] == "live"


@needs_criu
@pytest.mark.parametrize("owner,mode,linked", [(0, 0o644, True), (0, 0o664, False), (65534, 0o644, False)],
                         ids=["ours-linked", "group-writable-copied", "another-owner-copied"])
def test_a_restore_links_the_operators_file_into_the_store_only_when_no_one_else_can_write_it(
        tmp_path, owner, mode, linked):
    # On the store's filesystem, an archive only the supervisor's user can write is linked into
    # the store (no copy of its bytes before the restore, said in the log), and the store takes its
    # own copy after; one another user could change is copied before. Either way the store ends
    # with a file of its own, which a later write into the operator's file does not reach.
    rc, ev, err = agent_box(tmp_path / "a", "keep", 4)
    assert rc == 0, err
    src = tmp_path / "given.tar.zst"
    shutil.copy(one(ev, "checkpoint.created")["archive"], src)
    os.chown(src, owner, owner)
    os.chmod(src, mode)
    rc, ev2, err = box(tmp_path / "b", ["--restore", str(src)])
    assert rc == 0, err
    done = one(ev2, "restore.done")
    assert done["mode"] == "live"
    assert ("linked into the snapshot store" in err) == linked, err
    stored = tmp_path / "b" / "snapshots" / f"{done['snapshot']}.tar.zst"
    original = src.read_bytes()
    assert stored.read_bytes() == original
    assert os.stat(stored).st_ino != os.stat(src).st_ino and os.stat(src).st_nlink == 1
    assert not [p for p in (tmp_path / "b" / "snapshots").iterdir() if p.name.startswith((".import-", ".work-"))]
    with open(src, "r+b") as f:  # as cp or curl -o onto the same name would
        f.seek(1000)
        f.write(b"\0" * 4096)
    assert stored.read_bytes() == original


@pytest.mark.parametrize("why", ["no namespaces", "no criu"])
def test_without_live_checkpoint_fork_is_a_cold_restart_on_the_files(tmp_path, why):
    # Flat mode (no pid and mount namespace of its own), or no criu on PATH: no live checkpoint,
    # so the checkpoint is of the files only and says so, and each copy restarts the agent on them.
    if why == "no namespaces":
        rc, ev, err = agent_box(tmp_path / "s", "fork", 1, 0, "--set", "isolation.namespaces=false")
    else:
        path = ":".join(d for d in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(d, "criu")))
        rc, ev, err = agent_box(tmp_path / "s", "fork", 1, 0, environ=env(PATH=path))
    assert rc == 0, err
    started = one(ev, "box.started")
    assert started["capabilities"]["live_checkpoint"] is False
    created = one(ev, "checkpoint.created")
    assert created["mode"] == "fs" and "filesystem only" in created["note"]
    if why == "no criu":
        assert "criu was not found" in created["note"] and started["capabilities"]["criu"] is None
    done = [e for e in ev if e["type"] == "restore.done"]
    assert len(done) == 4 and {e["mode"] for e in done} == {"cold"}
    start = next(m for m in messages(ev) if m.get("start"))
    resumed = [m for m in messages(ev) if m.get("resumed")]
    assert len(resumed) == 4
    for m in resumed:
        assert m["snapshot"] == created["snapshot"] and m["before"] == start["nonce"]
    assert sorted(m["branch"] for m in resumed) == sorted(e["branch"] for e in done)


@needs_criu
def test_a_failed_dump_is_reported_and_the_agent_goes_on(tmp_path):
    # The agent keeps the capabilities and syscalls to make a pid namespace of its own.
    rc, ev, err = agent_box(tmp_path / "s", "nested", 1, 0, "--set", "isolation.capabilities=null", "--set",
                            "isolation.seccomp=none")
    assert rc == 0, err
    refused = next(m for m in messages(ev) if "refused" in m)
    assert refused["refused"] is True and refused["code"] == "criu", refused
    assert "criu dump failed" in refused["message"] and "nested pid namespace" in refused["message"]
    failed = one(ev, "checkpoint.failed")
    assert failed["error"]["message"] == refused["message"]
    assert any(m.get("still_running") for m in messages(ev))
    assert not (tmp_path / "s" / "snapshots").exists() or not any(
        p.name.startswith(".work") for p in (tmp_path / "s" / "snapshots").iterdir())


def test_a_files_only_checkpoint_restores_cold_in_a_new_box(tmp_path):
    # Flat mode, leave_running false: the files are saved with the tree stopped, the tree ends;
    # a new box from that archive restarts the agent on the files (restore.done mode cold).
    rc, ev, err = agent_box(tmp_path / "a", "restore", 1, 0, "--set", "isolation.namespaces=false")
    assert rc == 137, err
    created = one(ev, "checkpoint.created")
    assert created["mode"] == "fs" and created["leave_running"] is False
    ended = one(ev, "proc.exited")
    assert ended["reason"] == "killed" and ended["by"] == "checkpoint"
    start = next(m for m in messages(ev) if m.get("start"))
    rc, ev2, err = box(tmp_path / "b", ["--set", "isolation.namespaces=false", "--restore", created["archive"]])
    assert rc == 0, err
    done = one(ev2, "restore.done")
    assert done["mode"] == "cold" and done["branch"] == "main"
    resumed = [m for m in messages(ev2) if m.get("resumed")]
    assert len(resumed) == 1 and resumed[0]["before"] == start["nonce"]
    assert resumed[0]["snapshot"] == created["snapshot"]


SNAPSHOT_OPS = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ch = agent.Channel()
r = ch.checkpoint("one")
if r.get("copy"):
    print(json.dumps({"copy": True, "branch": ch.identity["branch"], "mode": ch.identity["mode"]}), flush=True)
    sys.exit(0)
out = {"snapshot": r["snapshot"], "list": ch.snapshots()}
out["restore"] = ch.restore(r["snapshot"])
out["delete"] = ch.request("snapshot.delete", snapshot=r["snapshot"])
out["list_after"] = ch.snapshots()
for bad in ({"id": r["snapshot"]}, {"id": "../../etc"}):
    try:
        ch.delete_snapshot(bad["id"])
    except agent.ChannelError as e:
        out.setdefault("refused", []).append([e.code, e.message])
try:
    ch.request("restore", snapshot="s-0000000000000000")
except agent.ChannelError as e:
    out["restore_missing"] = [e.code, e.message]
print(json.dumps(out), flush=True)
time.sleep(0.5)
'''


@needs_criu
def test_snapshot_list_restore_and_delete(tmp_path):
    s = tmp_path / "s"
    rc, ev, err = box(s, ["--", sys.executable, "-c", SNAPSHOT_OPS])
    assert rc == 0, err
    out = next(m for m in messages(ev, "main") if "list" in m)
    snap = out["snapshot"]
    assert [x["id"] for x in out["list"]] == [snap]
    assert out["list"][0]["mode"] == "live" and out["list"][0]["archive"]["bytes"] > 0
    copy = out["restore"]["copies"][0]
    assert out["restore"]["ok"] is True and copy["mode"] == "live"
    restored = [m for m in messages(ev, copy["branch"]) if m.get("copy")]
    assert restored == [{"copy": True, "branch": copy["branch"], "mode": "live"}]
    assert out["delete"]["ok"] is True and out["list_after"] == []
    assert not list((s / "snapshots").glob(snap + "*"))
    assert out["refused"][0][0] == "not_found" and out["refused"][1][0] == "bad_request"
    assert out["restore_missing"][0] == "bad_snapshot" and "no snapshot" in out["restore_missing"][1]
    assert one(ev, "snapshot.deleted")["snapshot"] == snap


FORK_OF_A_FORK = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ch = agent.Channel()
secret = os.urandom(8).hex()
level = 0
for _ in range(2):
    r = ch.fork(1)
    if not r["copy"]:
        break
    level += 1
print(json.dumps({"level": level, "secret": secret, "who": ch.whoami(), "file": agent.branch_info()}), flush=True)
time.sleep(0.3)
'''


@needs_criu
def test_a_copy_can_fork_itself_again(tmp_path):
    rc, ev, err = box(tmp_path / "s", ["--", sys.executable, "-c", FORK_OF_A_FORK])
    assert rc == 0, err
    out = sorted((m for m in messages(ev) if "level" in m), key=lambda m: m["level"])
    assert [m["level"] for m in out] == [0, 1, 2]
    assert len({m["secret"] for m in out}) == 1
    first, second = out[1]["who"], out[2]["who"]
    assert first["parent"] == "main" and second["parent"] == first["branch"]
    assert second["snapshot"] != first["snapshot"]
    assert out[2]["file"] == second and second["mode"] == "live"


LANDLOCKED = r'''
import json, os, sys
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
try:
    agent.Channel().checkpoint("x")
    print(json.dumps({"refused": False}), flush=True)
except agent.ChannelError as e:
    print(json.dumps({"refused": True, "code": e.code, "message": e.message}), flush=True)
'''


def test_restore_from_what_is_not_an_archive_file_says_so_and_never_waits(tmp_path):
    # A FIFO (which an open would wait on forever), a directory and a missing path: each is a
    # restore.failed naming it, the box exits 125 at once, and nothing is left in its store.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a").write_text("x")
    for name, why in [("fifo", "not a regular file, not an archive"), ("dir", "a directory, not an archive"),
                      ("missing", "No such file or directory")]:
        rc, ev, err = box(tmp_path / f"s-{name}", ["--restore", str(tmp_path / name)], timeout=30)
        assert rc == 125, err
        failed = one(ev, "restore.failed")
        assert failed["error"].startswith(f"{tmp_path / name}: ") and why in failed["error"], failed
        assert ev[-1]["type"] == "box.exited" and (ev[-1]["code"], ev[-1]["reason"]) == (125, "failed"), ev[-1]
        assert not list((tmp_path / f"s-{name}" / "snapshots").glob(".import-*"))


@pytest.mark.parametrize("landlock", [True, False])
def test_a_landlocked_tree_is_refused(tmp_path, landlock):
    # criu does not restore Landlock: a copy would run unconfined. Control: the same box without it.
    extra = ["--set", 'isolation.landlock={"rw": ["/workspace", "/tmp", "/dev"], "ro": ["/"]}'] if landlock else []
    rc, ev, err = box(tmp_path / "s", [*extra, "--", sys.executable, "-c", LANDLOCKED])
    assert rc == 0, err
    out = next(m for m in messages(ev) if "refused" in m)
    if landlock:
        assert out["refused"] is True and out["code"] == "landlocked" and "Landlock" in out["message"], out
        assert not any(e["type"] == "checkpoint.created" for e in ev)
    else:
        assert out["refused"] is False
        assert one(ev, "checkpoint.created")


def test_a_box_that_outlived_an_upgrade_of_its_programs_checkpoints_and_forks(tmp_path):
    # sandboxer upgraded while a box runs: sandboxer-ns-init replaced on the host (a new file renamed
    # over it, as a package manager does). The running ns-init's program was then a file with no
    # link left, which criu dumps only up to 1 MiB ("Can't dump ghost file
    # /run/sandboxer/bin/ns-init of 3182592 size, increase limit"): every checkpoint of the box
    # failed. A box now runs ns-init from a copy in the user's state dir, one per installed
    # version, which the upgrade leaves.
    from sbxtest import BIN, CLI, WsBox
    inst = tmp_path / "inst"
    (inst / "bin").mkdir(parents=True)
    for name in ("sandboxer-init", "sandboxer-ns-init"):
        shutil.copy2(BIN / name, inst / "bin" / name)
    (inst / "share").symlink_to(BIN.parent / "share")
    agent = ["sh", "-c", "echo started; exec sleep 60"]
    (tmp_path / "box").mkdir()
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    with WsBox(tmp_path / "box", agent, init=inst / "bin" / "sandboxer-init", env=env) as box:
        (copy,) = (tmp_path / "xdg/sandboxer").glob("ns-init-*")
        assert copy.read_bytes() == (BIN / "sandboxer-ns-init").read_bytes() and copy.stat().st_mode & 0o777 == 0o755
        shutil.copy2(BIN / "sandboxer-ns-init", inst / "bin" / "sandboxer-ns-init.new")
        os.rename(inst / "bin" / "sandboxer-ns-init.new", inst / "bin" / "sandboxer-ns-init")
        tf = ["--token-file", str(box.token_file)]
        r = subprocess.run([str(CLI), "checkpoint", box.url, *tf], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        snap = r.stdout.split()[-1]
        r = subprocess.run([str(CLI), "fork", box.url, "--snapshot", snap, "-n", "1", *tf], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == "f1 main@f1\n", r.stderr
        (done,) = [e for e in box.read_events() if e["type"] == "restore.done"]
        assert done["mode"] == "live", done
        # A second box of the new version runs a copy of its own; the first one's stays.
        (tmp_path / "box2").mkdir()
        with WsBox(tmp_path / "box2", ["true"], init=inst / "bin" / "sandboxer-init", env=env):
            assert len(list((tmp_path / "xdg/sandboxer").glob("ns-init-*"))) == 2 and copy.exists()
        # A file of the agent's own that it holds open after deleting it, past criu's own limit of
        # 1 MiB: carried in the images (test_deleted_files_the_agent_holds_are_carried...).
        big = "/tmp/held"
        r = subprocess.run([str(CLI), "exec", *tf, box.url, "--", "sh", "-c",
                            f"head -c 3000000 /dev/zero > {big}; (exec 7<{big}; rm {big}; exec sleep 60) "
                            "> /dev/null 2>&1 & sleep 0.3"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([str(CLI), "checkpoint", box.url, *tf], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


WRITES_WHILE_COPIED = r'''
import json, mmap, os, sys, threading, time
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ws = os.environ["SANDBOXER_WORKSPACE"]
d = os.path.join(ws, "files")
os.makedirs(d)
N, SLOTS, CYCLING = int(sys.argv[1]), 4096, 16
written, tmp_written, slots, cyc_written = {}, {}, [0] * SLOTS, {}
def body(n):
    return str(n) * (1 + n % 3)  # sizes change too
def put(k, n):
    path = os.path.join(d, str(k))
    if n % 4 == 1:  # a new file renamed over it
        with open(path + ".new", "w") as f:
            f.write(body(n))
        os.rename(path + ".new", path)
    else:  # in place
        with open(path, "w") as f:
            f.write(body(n))
    written[k] = n
for k in range(N):
    put(k, 0)
mf = open(os.path.join(ws, "mapped"), "w+b")
mf.write(bytes(8 * SLOTS))
mf.flush()
m = mmap.mmap(mf.fileno(), 8 * SLOTS)  # shared and writable: after a page's first write, its writes move no time
m[:] = bytes(8 * SLOTS)
for c in range(CYCLING):
    with open(os.path.join(ws, "cyc%d" % c), "wb") as f:
        f.write(bytes(8))
time.sleep(2.5)  # all of it older than the 2 s within which a file's times are not trusted
halt, parked = threading.Event(), threading.Event()
state = {"n": 0}
cyc = {}
def cycle(n):  # files mapped shared and writable for 0.3 s each, written through, then unmapped
    c = int(time.monotonic() / 0.3) % CYCLING
    if c not in cyc:
        for old in list(cyc):
            mo, fo = cyc.pop(old)
            mo.close()
            fo.close()
        f = open(os.path.join(ws, "cyc%d" % c), "r+b")
        cyc[c] = (mmap.mmap(f.fileno(), 8), f)
    cyc[c][0][0:8] = n.to_bytes(8, "little")
    cyc_written[c] = n
def writer():  # each step its own file of the first 200, of /tmp's 50, slot of the mapping, cycling file
    while not halt.is_set():
        n = state["n"] + 1
        cycle(n)
        put(n % 200, n)
        with open("/tmp/t%d" % (n % 50), "w") as f:
            f.write(str(n))
        tmp_written[n % 50] = n
        m[8 * (n % SLOTS):8 * (n % SLOTS) + 8] = n.to_bytes(8, "little")
        slots[n % SLOTS] = n
        state["n"] = n
    parked.set()
threading.Thread(target=writer, daemon=True).start()
while state["n"] < 600:
    time.sleep(0.01)
r = agent.Channel().fork(1, name="w")
halt.set()
parked.wait()  # the writer's step in flight at the stop is done (in a copy, by its restored thread)
bad = [k for k in range(N) if open(os.path.join(d, str(k))).read() != body(written.get(k, 0))]
bad_tmp = [k for k, n in tmp_written.items() if open("/tmp/t%d" % k).read() != str(n)]
bad_slots = [j for j in range(SLOTS) if int.from_bytes(m[8 * j:8 * j + 8], "little") != slots[j]]
bad_cyc = [c for c, n in cyc_written.items()
           if int.from_bytes(open(os.path.join(ws, "cyc%d" % c), "rb").read(), "little") != n]
print(json.dumps({"copy": bool(r.get("copy")), "n": state["n"], "bad": bad[:10], "nbad": len(bad),
                  "bad_tmp": bad_tmp, "bad_slots": bad_slots[:10], "nbad_slots": len(bad_slots), "bad_cyc": bad_cyc,
                  "names": sorted(os.listdir(d)) == sorted(map(str, range(N)))}), flush=True)
'''


@needs_criu
@pytest.mark.parametrize("disk,files", [("", 2000), ("64M", 2000), ("", 30000)])
def test_files_and_memory_agree_while_the_agent_writes_through_its_layers_copy(tmp_path, disk, files):
    """A checkpoint that leaves its agent running copies the layer while the agent runs, then,
    once it is stopped, what changed since (os::sync_tree). An agent makes 2000 files in its
    workspace, waits past the 2 s within which a file's times are not trusted, then writes 200 of
    them all the while (in place with other sizes, or a new file renamed over), its /tmp, and a
    file it maps shared (whose writes through a page written before move no time: on ext4 until
    the page is written back, on tmpfs ever), and forks itself: in the copy, every file holds what its
    memory says it wrote last, as in the parent. The controls (each check of the sync taken out in
    turn, by hand): without the mapped files copied again the mapped slots are stale; keeping
    every file the record names leaves the 200 stale. The workspace is on the state dir's
    filesystem, or a tmpfs of its own (resources.disk). Files mapped for 0.3 s each, written
    through and unmapped, in turn, all the while: with 30,000 files the copy takes long enough to
    be synced again while the agent runs (timings_ms.precopy_resyncs), and such a file mapped
    after the copy began, copied again by the sync, then written through and unmapped, must be
    copied again at the stop (each sync reads the maps at its start; the control, by hand: without
    that read, cycling files are stale)."""
    args = ["--set", f"resources.disk={disk}"] if disk else []
    rc, ev, err = box(tmp_path / "s", [*args, "--", sys.executable, "-c", WRITES_WHILE_COPIED, str(files)])
    assert rc == 0, err
    said = [m for m in messages(ev) if "copy" in m]
    assert sorted(m["copy"] for m in said) == [False, True], (said, err)
    for m in said:
        assert m["nbad"] == 0 and m["bad_tmp"] == [] and m["nbad_slots"] == 0 and m["bad_cyc"] == [] and m["names"], m
    created = one(ev, "checkpoint.created")
    assert created["timings_ms"]["precopy"] > 0, created["timings_ms"]
    if files > 2000:
        assert created["timings_ms"]["precopy_resyncs"] >= 1, created["timings_ms"]


HOLDS_DELETED_FILES = r'''
import hashlib, mmap, os, sys, tempfile, time
host = sys.argv[1]
spool = tempfile.TemporaryFile(dir="/workspace")  # no name left from the start
spool.write(os.urandom(5 << 20))
spool.flush()
held = open(os.path.join(host, "opened"), "rb")
with open(os.path.join(host, "mapped"), "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("ready", flush=True)
while True:
    spool.seek(0)
    print("spool", hashlib.sha256(spool.read()).hexdigest(), flush=True)
    for name in ("close", "unmap"):
        if os.path.exists("/workspace/" + name) and (held if name == "close" else mapped):
            (held if name == "close" else mapped).close()
            held, mapped = (None, mapped) if name == "close" else (held, None)
            print(name, "done", flush=True)
    time.sleep(0.2)
'''


@needs_criu
def test_deleted_files_the_agent_holds_are_carried_but_not_the_hosts(tmp_path):
    """A file the agent holds after its last link went (Python's TemporaryFile) is carried in the
    checkpoint however large (criu's own limit of 1 MiB failed it: "Can't dump ghost file"), and
    a fork's copy reads it. A host file the agent holds open or mapped from a read-only bind, which
    the host then deleted (an upgrade replacing a library), is refused, naming it: criu's restore
    wrote such a file back into the host's directory, remounting the bind writable (seen with
    inotify on the host's directory during a fork, for a file of 2 MB with this change's higher
    limit and for one under 1 MiB before it). Once the agent lets go of both, it checkpoints."""
    from sbxtest import CLI, output_of
    host = pathlib.Path(tempfile.mkdtemp(prefix="sbx-test-ghost-", dir="/var/tmp"))
    try:
        (host / "opened").write_bytes(os.urandom(300_000))
        (host / "mapped").write_bytes(os.urandom(2_000_000))
        with WsBox(tmp_path, [sys.executable, "-c", HOLDS_DELETED_FILES, str(host)]) as box:
            tf = ["--token-file", str(box.token_file)]

            def cli(*args):
                return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=60)

            def said(proc, text, timeout=30):
                box.wait_event(lambda e: text in output_of([e], proc).decode(), timeout)

            said("main", "spool ")
            r = cli("checkpoint", box.url, *tf)
            assert r.returncode == 0, r.stderr
            snap = r.stdout.split()[-1]
            r = cli("fork", box.url, "--snapshot", snap, "-n", "1", *tf)
            assert r.returncode == 0 and r.stdout == "f1 main@f1\n", r.stderr
            said("main@f1", "spool ")
            time.sleep(0.5)
            ev = box.read_events()
            spools = {p: {line for line in output_of(ev, p).decode().splitlines() if line.startswith("spool ")}
                      for p in ("main", "main@f1")}
            assert len(spools["main"]) == 1 and spools["main@f1"] == spools["main"], spools

            # The host deletes what the agent holds open, then what it maps: refused, naming each.
            for name, release in (("opened", "close"), ("mapped", "unmap")):
                (host / name).unlink()
                r = cli("checkpoint", box.url, *tf)
                assert r.returncode != 0, r.stdout
                assert f') holds "{host}/{name}" (on the read-only mount /var), deleted since it was ' \
                    "opened (the host replaced or removed it: an upgrade?); criu would write it back into that " \
                    "mount's directory at a restore. Restart what holds it, then checkpoint (host_file_deleted)" \
                    in r.stderr, r.stderr
                assert box.alive()
                (box.workspace / release).touch()
                said("main", f"{release} done")
            r = cli("checkpoint", box.url, *tf)
            assert r.returncode == 0, r.stderr
            assert sorted(os.listdir(host)) == []
            failed = [e for e in box.read_events() if e["type"] == "checkpoint.failed"]
            assert [e["error"]["code"] for e in failed] == ["host_file_deleted"] * 2, failed
    finally:
        shutil.rmtree(host)


def test_a_box_whose_token_file_under_tmp_was_removed_forks(tmp_path):
    # The box masks its token file where it is; under /tmp that mask sits in the branch's /tmp
    # overlay, which keeps it under the file's name. Once the host's file was gone (a script that
    # removes the token after the start), the checkpoint's mask list no longer named it, the copy's
    # /tmp had no mount point for it, and every fork failed ("Can't stat mountpoint
    # .../token"). The list now also takes the masks below /tmp from the branch's mount table.
    from sbxtest import CLI, WsBox
    assert str(tmp_path).startswith("/tmp/")
    with WsBox(tmp_path, ["sh", "-c", "echo started; exec sleep 60"]) as box:
        box.token_file.unlink()
        env = dict(os.environ, SANDBOXER_TOKEN=box.token)
        r = subprocess.run([str(CLI), "checkpoint", box.url], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        snap = r.stdout.split()[-1]
        r = subprocess.run([str(CLI), "fork", box.url, "--snapshot", snap, "-n", "1"], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 0 and r.stdout == "f1 main@f1\n", r.stderr
        (done,) = [e for e in box.read_events() if e["type"] == "restore.done"]
        assert done["mode"] == "live", done
        # The copy's agent does not see the token either (its mask is restored with it).
        r = subprocess.run([str(CLI), "exec", box.url, "--proc", "probe@f1", "--", "sh", "-c",
                            f"wc -c < {box.token_file}"], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr)


WRITE_THEN_CHECKPOINT = r'''
import json, os, sys
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
with open(os.path.join(os.environ["SANDBOXER_WORKSPACE"], "f"), "wb") as f:
    for _ in range(int(sys.argv[1])):
        f.write(os.urandom(1 << 20))
try:
    r = agent.Channel().checkpoint("x")
    print(json.dumps({"refused": False, "snapshot": r["snapshot"]}), flush=True)
except agent.ChannelError as e:
    print(json.dumps({"refused": True, "code": e.code, "message": e.message}), flush=True)
'''


@needs_criu
def test_a_layer_copy_that_would_take_the_journals_room_is_refused_naming_it(tmp_path):
    """Without a disk ceiling the workspace is on the state dir's filesystem, here a 192 MiB tmpfs.
    The agent writes 120 MiB there and checkpoints itself: the copy of its layer would take the
    state dir below the 16 MiB kept for the journal, so the checkpoint is refused with code
    no_space, naming that bound, before it writes past it; the agent goes on. The control, in the
    same test: 16 MiB is checkpointed. (Before, nothing bounded the copy: it wrote until the
    filesystem was full and failed with `No space left on device`, code io.)"""
    for mib, refused in ((120, True), (16, False)):
        state = tmp_path / f"s{mib}"
        state.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m,mode=0700", "tmpfs", str(state)], check=True)
        try:
            rc, ev, err = box(state, ["--", sys.executable, "-c", WRITE_THEN_CHECKPOINT, str(mib)])
            assert rc == 0, err
            out = next(m for m in messages(ev) if "refused" in m)
            assert out["refused"] is refused, (out, err)
            if not refused:
                assert one(ev, "checkpoint.created")["sizes"]["fs"] >= 16 << 20
                continue
            assert out["code"] == "no_space", out
            msg = out["message"]
            assert msg.startswith("snapshot the writable layer: copy "), msg
            assert "/workspace/f: its next " in msg, msg
            assert " bytes of data would leave less than 16777216 bytes free where it is copied to (" in msg, msg
            assert msg.endswith(" written by the copy), the room kept for the journal (what journal.disk_cap still "
                                "allows it, or 16 MiB without a cap)"), msg
            failed = one(ev, "checkpoint.failed")
            assert failed["error"] == {"code": "no_space", "message": msg}
            assert not any(e["type"] in ("checkpoint.created", "journal.degraded") for e in ev)
            assert not list((state / "snapshots").glob(".work-*"))  # nothing of it is left
        finally:
            unmount_below(state)


DELETED_FILES_THEN_CHECKPOINT = r'''
import json, os, sys, tempfile
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
held = []
for i in range(4):
    f = tempfile.TemporaryFile(dir=os.environ["SANDBOXER_WORKSPACE"])  # no name from the start
    f.write(os.urandom(16 << 20))
    f.flush()
    held.append(f)
for keep in (4, 1):
    for f in held[keep:]:
        f.close()
    try:
        r = agent.Channel().checkpoint(f"holds-{keep}")
        print(json.dumps({"refused": False, "snapshot": r["snapshot"]}), flush=True)
    except agent.ChannelError as e:
        print(json.dumps({"refused": True, "code": e.code, "message": e.message}), flush=True)
'''


@needs_criu
def test_deleted_files_that_together_would_fill_the_state_dir_are_refused_naming_them(tmp_path):
    """criu's --ghost-limit is a file's: the agent holds four deleted files of 16 MiB in its
    workspace, on the state dir's filesystem (a 128 MiB tmpfs), each within the room a checkpoint
    has there, the four not. The checkpoint is refused with code no_space, naming their count, sum
    and the largest, before criu runs; the journal and the agent go on. The control, in the same
    run: once it holds one, it checkpoints. (Before, criu wrote them until the filesystem was full:
    "criu dump failed: Can't send ghost to image: No space left on device (criu/files-reg.c:178)",
    code criu, seen by hand with the check taken out.)"""
    state = tmp_path / "s"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m,mode=0700", "tmpfs", str(state)], check=True)
    try:
        rc, ev, err = box(state, ["--", sys.executable, "-c", DELETED_FILES_THEN_CHECKPOINT])
        assert rc == 0, err
        four, one_held = [m for m in messages(ev) if "refused" in m]
        assert four["refused"] is True and four["code"] == "no_space", four
        assert re.fullmatch(
            r"the branch's processes hold 4 files deleted since they were opened, 67108864 bytes together \(the "
            r"largest: process \d+ \(python[\d.]*\) holds \"/workspace/#\d+\", 16777216 bytes\), which criu carries in "
            r"the checkpoint: more than the \d+ bytes the state dir's filesystem has for it. Close them, or give the "
            r"state dir more space", four["message"]), four["message"]
        assert one(ev, "checkpoint.failed")["error"] == {"code": "no_space", "message": four["message"]}
        assert one_held["refused"] is False, (one_held, err)
        assert one(ev, "checkpoint.created")["name"] == "holds-1"
        assert not any(e["type"] == "journal.degraded" for e in ev)
    finally:
        unmount_below(state)


EMPTY_FILES_THEN_CHECKPOINT = r'''
import json, os, sys
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ws = os.environ["SANDBOXER_WORKSPACE"]
for d in range(int(sys.argv[1])):
    os.mkdir(os.path.join(ws, str(d)))
    for i in range(100):
        os.close(os.open(os.path.join(ws, str(d), str(i)), os.O_CREAT | os.O_WRONLY, 0o644))
try:
    r = agent.Channel().checkpoint("x")
    print(json.dumps({"refused": False, "snapshot": r["snapshot"]}), flush=True)
except agent.ChannelError as e:
    print(json.dumps({"refused": True, "code": e.code, "message": e.message}), flush=True)
print(json.dumps({"after": len(os.listdir(ws))}), flush=True)
'''


@needs_criu
def test_a_layer_copy_of_empty_files_leaves_the_state_dirs_inodes_for_the_journal(tmp_path):
    """Empty files cost no bytes: under a disk ceiling of 32M an agent makes 6000 of them (its
    workspace is a tmpfs of its own) and checkpoints itself into a state dir whose filesystem has
    4000 inodes. The copy stops while 1024 are still free, with code no_space naming the inodes;
    nothing of it is left, the journal goes on, the agent too. The control, in the same test: 500
    files are checkpointed. (Before, the copy took every inode and failed at ENOSPC, code io.)"""
    for dirs, refused in ((60, True), (5, False)):
        state = tmp_path / f"s{dirs}"
        state.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m,nr_inodes=4000,mode=0700", "tmpfs", str(state)],
                       check=True)
        try:
            rc, ev, err = box(state, ["--set", "resources.disk=32M", "--", sys.executable, "-c",
                                      EMPTY_FILES_THEN_CHECKPOINT, str(dirs)])
            assert rc == 0, err
            out = next(m for m in messages(ev) if "refused" in m)
            assert out["refused"] is refused, (out, err)
            assert next(m for m in messages(ev) if "after" in m) == {"after": dirs}
            if not refused:
                assert one(ev, "checkpoint.created")
                continue
            assert out["code"] == "no_space", out
            msg = out["message"]
            assert msg.startswith("snapshot the writable layer: copy "), msg
            assert "/workspace/" in msg and ": its next inodes would leave fewer than 1024 free where it is " \
                "copied to (" in msg, msg
            assert msg.endswith(" made by the copy), the inodes the state dir's filesystem keeps free for the "
                                "journal"), msg
            assert one(ev, "checkpoint.failed")["error"] == {"code": "no_space", "message": msg}
            assert not any(e["type"] in ("checkpoint.created", "journal.degraded") for e in ev)
            assert ev[-1]["type"] == "box.exited", ev[-1]
            assert not list((state / "snapshots").glob(".work-*"))  # nothing of it is left
        finally:
            unmount_below(state)


LINKS_AND_HOLES = r'''
import hashlib, json, os, signal, sys, time
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ws = os.environ["SANDBOXER_WORKSPACE"]
p = lambda n: os.path.join(ws, n)

def used(root):
    seen, n = set(), 0
    for d, _, names in os.walk(root):
        for x in names:
            st = os.lstat(os.path.join(d, x))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                n += st.st_blocks * 512
    return n

def report(where):
    st = {n: os.stat(p(n)) for n in ("r", "l1", "l150", "l300", "big")}
    h = hashlib.sha256()
    with open(p("big"), "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    print(json.dumps({"where": where, "inodes": len({st[n].st_ino for n in ("r", "l1", "l150", "l300")}),
                      "nlink": st["r"].st_nlink, "r": hashlib.sha256(open(p("l300"), "rb").read()).hexdigest(),
                      "big_size": st["big"].st_size, "big_blocks": st["big"].st_blocks * 512, "big": h.hexdigest(),
                      "used": used(ws)}), flush=True)

# The audit's agent: 1 MiB linked 300 times, and a 1 GiB file of holes (4 KiB of data at its start
# and at 512 MiB, so its contents say where they are).
with open(p("r"), "wb") as f:
    f.write(os.urandom(1 << 20))
for i in range(1, 301):
    os.link(p("r"), p(f"l{i}"))
with open(p("big"), "wb") as f:
    f.write(b"a" * 4096)
    f.seek(512 << 20)
    f.write(b"b" * 4096)
    f.truncate(1 << 30)
report("before")
ch = agent.Channel()
r = ch.fork(1)
if r["copy"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # its report comes before the box's end
    report("copy")
    sys.exit(0)
# A copy restored from the stored snapshot too (its files from snapshots/<id>.d, not the fork's tree).
ch.restore(r["snapshot"])
report("original")
time.sleep(float(sys.argv[1]))
'''


def blocks(root):
    """The bytes a tree takes on its filesystem: every inode's blocks, once."""
    seen, n = set(), 0
    for p in [pathlib.Path(root), *pathlib.Path(root).rglob("*")]:
        st = p.lstat()
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            n += st.st_blocks * 512
    return n


@needs_criu
def test_a_checkpoint_of_hard_links_and_holes_takes_what_they_take_and_restores_them(tmp_path):
    """The audit's repro, as the agent's own fork: under resources.disk=256M the agent links 1 MiB
    300 times and makes a 1 GiB file of holes (980 KB of its workspace used). Its snapshot's layer
    takes about that on the state dir's disk (sizes.fs 1 MiB; the archive about its images), and
    every copy (the fork's, one restored from the stored snapshot, one restored from the archive
    in a new box under the same ceiling) has one inode of 301 names and the same 1 GiB file, as
    sparse. Before, sizes.fs was 1.37 GB, snapshots/<id>.d kept 1.3 GB, and no copy fitted the
    copy's 256M workspace."""
    try:
        rc, ev, err = box(tmp_path / "a", ["--set", "resources.disk=256M", "--", sys.executable, "-c", LINKS_AND_HOLES,
                                           "20"], timeout=240)
        assert rc == 0, err
        reports = {(e["branch"], e["message"]["where"]): e["message"] for e in ev
                   if e["type"] == "proc.message" and "where" in e["message"]}
        before = reports[("main", "before")]
        assert before["inodes"] == 1 and before["nlink"] == 301 and before["used"] < 2 << 20, before
        copies = [m for (b, w), m in reports.items() if w == "copy"]
        assert len(copies) == 2, (reports, err)
        for m in copies + [reports[("main", "original")]]:
            assert {k: m[k] for k in ("inodes", "nlink", "r", "big_size", "big")} == \
                {k: before[k] for k in ("inodes", "nlink", "r", "big_size", "big")}, (m, before)
            assert m["big_blocks"] < 1 << 20 and m["used"] < 2 << 20, m
        created = one(ev, "checkpoint.created")
        assert created["sizes"]["fs"] < 2 << 20, created["sizes"]  # was 1,374,741,923
        snap = tmp_path / "a" / "snapshots" / created["snapshot"]
        assert blocks(snap.with_suffix(".d") / "fs") < 2 << 20
        assert blocks(snap.with_suffix(".d")) < created["sizes"]["images"] + (4 << 20)
        archive = snap.with_suffix(".tar.zst")
        assert archive.stat().st_size < created["sizes"]["images"] + (4 << 20)
        # The archive, in a new box under the same ceiling: extracted (links linked, holes left),
        # then copied into the copy's workspace.
        rc, ev2, err = box(tmp_path / "b", ["--set", "resources.disk=256M", "--restore", str(archive)], timeout=240)
        assert rc == 0, err
        assert one(ev2, "restore.done")["mode"] == "live"
        restored = next(e["message"] for e in ev2 if e["type"] == "proc.message" and e["message"].get("where") == "copy")
        assert {k: restored[k] for k in ("inodes", "nlink", "r", "big_size", "big")} == \
            {k: before[k] for k in ("inodes", "nlink", "r", "big_size", "big")}, restored
        assert restored["big_blocks"] < 1 << 20 and restored["used"] < 2 << 20, restored
        extracted = tmp_path / "b" / "snapshots" / f"{created['snapshot']}.d"
        assert blocks(extracted / "fs") < 2 << 20
    finally:
        unmount_below(tmp_path)



def test_a_checkpoint_of_a_file_under_the_agents_lease_fails_at_once_and_the_agent_goes_on(tmp_path):
    # The layer copy opened each file blocking: under a lease held by the stopped agent (which
    # cannot give it up) the open waited lease-break-time, 45 s a file, the tree stopped.
    with WsBox(tmp_path, ["python3", "-c", LEASE_AGENT]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                await wait_for_path(s, "/workspace/ready")
                r = await s.request("checkpoint", timeout=20)
                n = len(box.read_events())
                await asyncio.sleep(0.5)
                return r, n
        r, n = run(go())
        assert not r["ok"] and "holds a lease on it" in r["error"]["message"], r
        assert "/workspace/leased" in r["error"]["message"] or "leased" in r["error"]["message"], r
        assert len(box.read_events()) > n  # the agent goes on printing
