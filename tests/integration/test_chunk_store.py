"""The chunk store that the box's own snapshots share (checkpoint/README.md, "The chunk store"):
ten periodic live checkpoints of an agent holding 200 MiB that changes 5 MiB between them grow the
store by what changed, deleting the middle ones frees only their own chunks and keeps the others
restorable, and a snapshot kept as chunks exports as an archive another box restores. Real criu."""
import json
import os
import shutil
import subprocess
import time

import pytest

from sbxtest import CLI, INIT, Session, WsBox, of_type, run, ws_connect

pytestmark = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")

MiB = 1 << 20
# 200 MiB of random bytes (nothing to compress or share within it), then 5 MiB of it replaced
# each second, each change said on stdout right after it is made.
AGENT = ("import json, os, time\n"
         "heap = bytearray(os.urandom(200 << 20))\n"
         "print(json.dumps({'ready': 1}), flush=True)\n"
         "i = 0\n"
         "while True:\n"
         "    time.sleep(1.0)\n"
         "    off = (i * (5 << 20)) % len(heap)\n"
         "    heap[off:off + (5 << 20)] = os.urandom(5 << 20)\n"
         "    i += 1\n"
         "    print(json.dumps({'changed': i}), flush=True)\n")


def chunk_files(state):
    return {p.name: p.stat().st_size for p in (state / "snapshots" / "chunks").glob("??/*") if len(p.name) == 64}


def chunk_list(state, snap):
    return json.loads((state / "snapshots" / f"{snap}.chunks").read_text())


def cli(*args, token):
    return subprocess.run([str(CLI), *args, "--token-file", str(token)], capture_output=True, text=True, timeout=180)


def delta_moves_into_a_box_with_its_base(tmp_path, base_archive, delta, first, last):
    """Another box: the delta is refused until it has the base, a damaged delta is refused naming
    the chunk, and then the delta makes the same snapshot, which restores live."""
    damaged = tmp_path / "damaged.delta"
    data = bytearray(delta.read_bytes())
    data[-1000] ^= 0xFF  # inside the last included chunk
    damaged.write_bytes(bytes(data))
    other = tmp_path / "other"
    other.mkdir()
    with WsBox(other, ["sleep", "600"]) as b:
        early = cli("import", b.url, str(delta), token=b.token_file)
        assert early.returncode != 0 and f"import {first} first" in early.stderr, early.stderr
        assert cli("import", b.url, str(base_archive), token=b.token_file).stdout.split()[-1] == first
        bad = cli("import", b.url, str(damaged), token=b.token_file)
        assert bad.returncode != 0 and "is corrupted" in bad.stderr, bad.stderr
        got = cli("import", b.url, str(delta), "--json", token=b.token_file)
        assert got.returncode == 0, got.stderr
        reply = json.loads(got.stdout.splitlines()[0])
        assert reply["snapshot"] == last and reply["base"] == first and reply["trusted"], reply
        assert reply["added_bytes"] < delta.stat().st_size
        listed = sorted(p.name[:-5] for p in (b.state / "snapshots").glob("s-*.json"))
        assert listed == sorted([first, last])

        async def restore():
            async with ws_connect(b) as ws:
                return await Session(ws).request("restore", snapshot=last, timeout=120)

        r = run(restore(), timeout=180)
        assert r["ok"] and r["copies"][0]["mode"] == "live", r
        branch = r["copies"][0]["branch"]
        b.wait_event(lambda e: e["type"] == "proc.message" and e["branch"] == branch and "changed" in e["message"],
                     timeout=30)


@pytest.mark.alone  # what changes between snapshots is paced by the clock: other load stretches it
def test_periodic_snapshots_grow_the_store_by_what_changed(tmp_path):
    sets = ["checkpoint.every=1s", "checkpoint.keep=20", "resources.snapshots=24"]
    with WsBox(tmp_path, ["python3", "-c", AGENT], extra=[a for s in sets for a in ("--set", s)]) as box:
        deadline = time.monotonic() + 120
        while True:
            events = box.read_events()
            ready = [e for e in events if e["type"] == "proc.message" and "ready" in e["message"]]
            created = of_type(events, "checkpoint.created")
            index = {e["snapshot"]: json.loads((box.state / "snapshots" / f"{e['snapshot']}.json").read_text())
                     for e in created}
            after = [e for e in created if ready and index[e["snapshot"]]["last_seq"] >= ready[0]["seq"]]
            if len(after) >= 10:
                break
            assert time.monotonic() < deadline, box.stderr()
            time.sleep(0.2)
        after = after[:10]
        changes = [e["seq"] for e in events if e["type"] == "proc.message" and "changed" in e["message"]]
        store = box.state / "snapshots"
        # Kept as chunks only: no archive file, no extracted copy.
        assert not list(store.glob("*.tar.zst")) and not list(store.glob("*.d"))
        # The store's own accounting is its disk: every chunk file was added by exactly one snapshot.
        assert sum(e["sizes"]["added"] for e in created) == sum(chunk_files(box.state).values())
        # The heap went in whole once (random: it does not compress), by the first snapshot after
        # it was made or one just before its "ready" line reached the journal.
        upto = created[:created.index(after[0]) + 1]
        assert sum(e["sizes"]["added"] for e in upto) >= 200 * MiB
        grew = []
        for prev, cur in zip(after, after[1:]):
            lo, hi = index[prev["snapshot"]]["last_seq"], index[cur["snapshot"]]["last_seq"]
            changed = sum(1 for s in changes if lo < s <= hi) * 5 * MiB
            grew.append((cur["sizes"]["added"], changed))
            assert cur["sizes"]["added"] < 3 * max(changed, 5 * MiB), grew
            assert cur["sizes"]["compressed"] >= 200 * MiB  # each names the whole heap
        # The agent did change between them (else the bound above says nothing).
        assert sum(c for _, c in grew) >= 5 * 5 * MiB, grew

        # Delete the middle eight: only the chunks no other snapshot names go.
        first, last = after[0]["snapshot"], after[-1]["snapshot"]
        middle = [e["snapshot"] for e in after[1:-1]]
        named_by_middle = {c[0] for snap in middle for c in chunk_list(box.state, snap)["chunks"]}

        async def delete_then_restore():
            async with ws_connect(box) as ws:
                s = Session(ws)
                for snap in middle:
                    r = await s.request("snapshot.delete", snapshot=snap)
                    assert r["ok"], r
                return [await s.request("restore", snapshot=snap, timeout=120) for snap in (first, last)]

        restored = run(delete_then_restore(), timeout=240)
        # Checkpoints go on meanwhile: one under way has stored chunks its list does not name yet
        # (a middle one's among them, where its memory is the same), so the store is looked at
        # again until no checkpoint is half-written. A live chunk gone, or a freed one kept, stays.
        for _ in range(40):
            on_disk = set(chunk_files(box.state))
            live = set()
            for snap in [e["snapshot"] for e in of_type(box.read_events(), "checkpoint.created")]:
                if (store / f"{snap}.chunks").exists():
                    live |= {c[0] for c in chunk_list(box.state, snap)["chunks"]}
            freed = named_by_middle - live
            if live <= on_disk and not freed & on_disk:
                break
            time.sleep(0.5)
        assert live <= on_disk, sorted(live - on_disk)[:3]
        assert not freed & on_disk, sorted(freed & on_disk)[:3]
        assert len(freed) * 256 * 1024 >= 5 * 5 * MiB  # the middle ones' own changes (chunks <= 256 KiB)
        for snap in middle:
            assert not (store / f"{snap}.chunks").exists() and not (store / f"{snap}.json").exists()
        # The kept ones restore live, from the store, and their agents go on changing memory.
        for r in restored:
            assert r["ok"] and r["copies"][0]["mode"] == "live", r
        for r in restored:
            branch = r["copies"][0]["branch"]
            box.wait_event(lambda e: e["type"] == "proc.message" and e["branch"] == branch
                           and "changed" in e["message"], timeout=30)

        # Exported, a snapshot kept as chunks is an archive like any other: a new box restores it.
        archive = tmp_path / "last.tar.zst"
        e = cli("export", box.url, last, str(archive), token=box.token_file)
        assert e.returncode == 0, e.stderr
        # Against a base: only the chunks the base lacks.
        base_archive, delta = tmp_path / "first.tar.zst", tmp_path / "last.delta"
        assert cli("export", box.url, first, str(base_archive), token=box.token_file).returncode == 0
        e = cli("export", box.url, last, str(delta), "--base", first, token=box.token_file)
        assert e.returncode == 0, e.stderr
        changed = sum(c for _, c in grew)
        assert delta.stat().st_size < 3 * changed + 2 * MiB, (delta.stat().st_size, changed)
        assert delta.stat().st_size < archive.stat().st_size / 2
        delta_moves_into_a_box_with_its_base(tmp_path, base_archive, delta, first, last)
    events = tmp_path / "other.jsonl"
    other = subprocess.Popen([str(INIT), "--state-dir", str(tmp_path / "other"), "--events", str(events),
                              "--restore", str(archive)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        from sbxtest import wait_event
        done = wait_event(events, lambda ev: ev["type"] == "restore.done", timeout=60)
        assert done["mode"] == "live", done
        wait_event(events, lambda ev: ev["type"] == "proc.message" and "changed" in ev["message"], timeout=30)
    finally:
        other.terminate()
        other.wait(30)


# 24 MiB of random bytes, then a line a second: a snapshot of it takes about 25 MiB.
SMALL_AGENT = ("import json, os, time\n"
               "heap = bytearray(os.urandom(24 << 20))\n"
               "i = 0\n"
               "while True:\n"
               "    i += 1\n"
               "    print(json.dumps({'tick': i}), flush=True)\n"
               "    time.sleep(0.2)\n")


@pytest.mark.parametrize("cap, kept", [("8M", True), ("48M", False), ("96M", False)])
def test_snapshots_leave_the_journal_its_room(tmp_path, cap, kept):
    """The state dir is a 64 MiB tmpfs. With journal.disk_cap 8M a periodic snapshot (~25 MiB) is
    kept (the control); with 48M it would leave less than the journal's room and is not kept; with
    96M there is not that much free to begin with and the agent is not even stopped. Either way
    the agent and the journal go on."""
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state)], check=True)
    try:
        sets = ["checkpoint.every=1s", "checkpoint.keep=1", f"journal.disk_cap={cap}"]
        with WsBox(tmp_path, ["python3", "-c", SMALL_AGENT], extra=[a for s in sets for a in ("--set", s)]) as box:
            first = box.wait_event(lambda e: e["type"] in ("checkpoint.created", "persist.failed"), timeout=60)
            if kept:
                assert first["type"] == "checkpoint.created", first
                assert (state / "snapshots" / f"{first['snapshot']}.chunks").exists()
            else:
                assert first["type"] == "persist.failed" and first["error"]["code"] == "no_space", first
                msg = first["error"]["message"]
                assert "kept for the journal first" in msg, msg
                assert msg.startswith("checkpoint refused" if cap == "96M" else "checkpoint not kept"), msg
                assert not list((state / "snapshots").glob("s-*"))
                # Its chunks went with it.
                assert not [p for p in (state / "snapshots" / "chunks").glob("??/*") if len(p.name) == 64]
                stopped = [e for e in box.read_events() if e["type"] == "checkpoint.failed"]
                assert bool(stopped) == (cap == "48M")  # refused up front: the agent was never stopped
            ticks = [e for e in box.read_events() if e["type"] == "proc.message"]
            box.wait_event(lambda e: e["type"] == "proc.message" and e["message"]["tick"] > ticks[-1]["message"]["tick"] + 3)
            assert box.alive()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


@pytest.mark.parametrize("cap, imported", [("", False), ("1M", True)])
def test_an_import_leaves_the_journal_its_room(tmp_path, cap, imported):
    """An idle box's state dir is a 24 MiB tmpfs; the archive is ~6 MiB of random heap. Its upload
    and extraction fit (12 MiB), but without journal.disk_cap the journal is kept 16 MiB first, so
    the import is refused before a byte is written, saying so; with a 1 MiB cap (the control) the
    same archive is imported. The box serves on either way."""
    agent = SMALL_AGENT.replace("24 << 20", "6 << 20")
    (tmp_path / "a").mkdir()
    (tmp_path / "t").mkdir()
    state = tmp_path / "t" / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(state)], check=True)
    try:
        sets = ["--set", f"journal.disk_cap={cap}"] if cap else []
        with WsBox(tmp_path / "a", ["python3", "-c", agent]) as a, \
                WsBox(tmp_path / "t", [], extra=["--idle", *sets]) as t:
            a.wait_event(lambda e: e["type"] == "proc.message")
            snap = subprocess.run([CLI, "checkpoint", a.url, "--token-file", str(a.token_file)], check=True,
                                  capture_output=True, text=True, timeout=60).stdout.split()[-1]
            archive = tmp_path / "s.tar.zst"
            subprocess.run([CLI, "export", a.url, snap, str(archive), "--token-file", str(a.token_file)], check=True,
                           capture_output=True, timeout=60)
            assert 5 << 20 < archive.stat().st_size < 8 << 20
            r = subprocess.run([CLI, "import", t.url, str(archive), "--token-file", str(t.token_file)],
                               capture_output=True, text=True, timeout=60)
            if imported:
                assert r.returncode == 0 and r.stdout.split()[-1] == snap, r.stderr
            else:
                assert r.returncode == 1, r.stdout
                assert "no_space" in r.stderr and "16777216 are kept for the journal first" in r.stderr, r.stderr
                assert not [p for p in (state / "snapshots").glob("*")
                            if p.name.startswith(("s-", ".import"))] if (state / "snapshots").exists() else True
            assert t.alive()
            r = subprocess.run([CLI, "stats", t.url, "--token-file", str(t.token_file)], capture_output=True,
                               timeout=30)
            assert r.returncode == 0
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_a_fork_leaves_the_journal_its_room(tmp_path):
    """A box's state dir is a 96 MiB tmpfs and its agent's workspace holds 12 MiB of random bytes,
    journal.disk_cap 1 MiB. After a checkpoint (its archive and extraction), a fork of 6 would
    write 6 copies of those files, more than is free: refused before any copy starts, saying how
    much it needed; a fork of 2 (the control) runs. The box serves on either way."""
    agent = ("import json, os, time\n"
             "open('/workspace/blob', 'wb').write(os.urandom(12 << 20))\n"
             "print(json.dumps({'ready': 1}), flush=True)\n"
             "time.sleep(600)\n")
    (tmp_path / "a").mkdir()
    state = tmp_path / "a" / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(state)], check=True)
    try:
        with WsBox(tmp_path / "a", ["python3", "-c", agent], extra=["--set", "journal.disk_cap=1M"]) as a:
            a.wait_event(lambda e: e["type"] == "proc.message")
            tok = ["--token-file", str(a.token_file)]
            snap = subprocess.run([CLI, "checkpoint", a.url, *tok], check=True, capture_output=True, text=True,
                                  timeout=60).stdout.split()[-1]
            r = subprocess.run([CLI, "fork", a.url, "--snapshot", snap, "-n", "6", *tok], capture_output=True,
                               text=True, timeout=120)
            assert r.returncode != 0 and "no_space" in r.stderr, (r.stdout, r.stderr)
            needed = int(r.stderr.split(" for 6 copies' files")[0].rsplit(" ", 1)[1])
            assert 6 * (12 << 20) <= needed < 6 * (13 << 20), r.stderr  # the 12 MiB file, 6 times
            assert sorted(p.name for p in (state / "branches").iterdir()) == ["main"]
            failed = a.wait_event(lambda e: e["type"] == "restore.failed")
            assert "6 copies' files" in failed["error"], failed
            r = subprocess.run([CLI, "fork", a.url, "--snapshot", snap, "-n", "2", *tok], capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0 and len(r.stdout.split("\n")) >= 2, r.stderr
            assert a.alive()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


HOLDER = ("import os, time\n"
          "keep = os.urandom(8 << 20)\n"
          "n = 0\n"
          "while True:\n"
          "    n += 1\n"
          "    print(n, flush=True)\n"
          "    time.sleep(0.1)\n")


@pytest.mark.parametrize("section", [True, False], ids=["persisting-box-chunks", "control-no-section-archives"])
def test_a_checkpoint_asked_for_in_a_persisting_box_joins_the_chunk_store(tmp_path, section):
    # In a box whose profile keeps snapshots of its own, the operator's (and the channel's)
    # checkpoints go to the chunk store too: the second adds what changed, not the 8 MiB again.
    # Control: without the section, each is a whole archive.
    extra = ["--set", "checkpoint.on_stop=true"] if section else []
    with WsBox(tmp_path, ["python3", "-c", HOLDER], extra=[*extra, "--set", "resources.grace=1s"]) as box:
        time.sleep(1.0)
        snaps = []
        for _ in range(2):
            r = cli("checkpoint", box.url, "--name", "mine", token=box.token_file)
            assert r.returncode == 0, r.stderr
            snaps.append(r.stdout.split()[-1])
        created = {e["snapshot"]: e for e in of_type(box.read_events(), "checkpoint.created")}
        first, second = created[snaps[0]], created[snaps[1]]
        store = box.state / "snapshots"
        if section:
            assert "archive" not in first and not list(store.glob("*.tar.zst")), first
            assert first["sizes"]["added"] >= 8 * MiB
            assert second["sizes"]["added"] < 2 * MiB, second["sizes"]
        else:
            assert "added" not in second["sizes"] and second["sizes"]["compressed"] >= 8 * MiB, second["sizes"]
            assert (store / f"{snaps[1]}.tar.zst").exists()
        # Either way it exports as an archive named by its id, and a fork of it runs live.
        out = tmp_path / "out.tar.zst"
        e = cli("export", box.url, snaps[1], str(out), token=box.token_file)
        assert e.returncode == 0 and out.stat().st_size >= 8 * MiB, e.stderr
        f = cli("fork", box.url, "--snapshot", snaps[1], "-n", "1", token=box.token_file)
        assert f.returncode == 0, f.stderr
        done = [x for x in of_type(box.read_events(), "restore.done") if x["snapshot"] == snaps[1]]
        assert done and done[0]["mode"] == "live", done
        # A fork of the live branch: its copies run before the seal, and its snapshot is stored
        # the same way.
        g = cli("fork", box.url, "--branch", "main", "-n", "2", token=box.token_file)
        assert g.returncode == 0, g.stderr
        forked = of_type(box.read_events(), "fork.created")[-1]
        assert len(forked["copies"]) == 2 and all(c["mode"] == "live" for c in forked["copies"]), forked
        assert (store / f"{forked['snapshot']}.tar.zst").exists() != section, forked
        assert (store / f"{forked['snapshot']}.chunks").exists() == section, forked


@pytest.mark.parametrize("size, counted", [("24m", False), ("64m", True)], ids=["no-room-to-cut", "control-room"])
def test_lacks_does_not_cut_archives_into_chunks_past_the_journals_room(tmp_path, size, counted):
    """An idle box on a small tmpfs holds an imported ~6 MiB archive (and its extraction). Asked
    which of that snapshot's chunks it lacks, it would cut the archive into its chunk store first:
    on 24 MiB with 1 MiB kept for the journal there is no room, so it answers from its store as it
    is (it lacks them all) and snapshot.chunks of that snapshot is refused with no_space; on 64 MiB
    (the control) it has them all. The box serves on either way."""
    agent = SMALL_AGENT.replace("24 << 20", "6 << 20")
    (tmp_path / "a").mkdir()
    (tmp_path / "t").mkdir()
    state = tmp_path / "t" / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(state)], check=True)
    try:
        with WsBox(tmp_path / "a", ["python3", "-c", agent]) as a, \
                WsBox(tmp_path / "t", [], extra=["--idle", "--set", "journal.disk_cap=1M"]) as t:
            a.wait_event(lambda e: e["type"] == "proc.message")
            snap = cli("checkpoint", a.url, token=a.token_file).stdout.split()[-1]
            archive = tmp_path / "s.tar.zst"
            assert cli("export", a.url, snap, str(archive), token=a.token_file).returncode == 0
            r = cli("import", t.url, str(archive), token=t.token_file)
            assert r.returncode == 0, r.stderr

            async def ask():
                async with ws_connect(a) as ws:
                    page = await Session(ws).request("snapshot.chunks", snapshot=snap)
                async with ws_connect(t) as ws:
                    s = Session(ws)
                    return page, await s.request("snapshot.lacks", hashes=page["hashes"]), \
                        await s.request("snapshot.chunks", snapshot=snap)

            page, lacks, theirs = run(ask(), timeout=120)
            assert page["ok"], page
            assert lacks["ok"] and lacks["lacking"] == (0 if counted else page["count"]), lacks
            if counted:
                assert theirs["ok"] and theirs["hashes"] == page["hashes"], theirs
            else:
                assert theirs["error"]["code"] == "no_space" and "kept for the journal first" in \
                    theirs["error"]["message"], theirs
            assert t.alive()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)
