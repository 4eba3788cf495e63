"""sdk/python's checkpoint and snapshot methods against the real supervisor."""
import base64
import hashlib
import io
import json
import subprocess
import tarfile

import pytest

from sandboxer import Box, SandboxerError
from sbxtest import run


async def _served(box, op):
    """Whether the server knows `op` (an unknown one is refused with unknown_op)."""
    try:
        await box.request(op, snapshot="s-0000000000000000")
    except SandboxerError as e:
        return e.code != "unknown_op"
    return True


def test_checkpoint_then_the_snapshot_is_listed_and_can_be_deleted(server):
    async def go():
        async with await Box.connect(server.url, server.token) as box:
            assert await _served(box, "snapshot.list")
            reply = await box.checkpoint("sdk-test")
            sid = reply.get("snapshot") or reply.get("id")
            listed = [s.get("id") or s.get("snapshot") for s in await box.snapshots()]
            await box.delete_snapshot(sid)
            after = [s.get("id") or s.get("snapshot") for s in await box.snapshots()]
            return sid, listed, after
    sid, listed, after = run(go(), 90)
    assert sid in listed and sid not in after


def test_unknown_snapshot_is_a_typed_error(server):
    async def go():
        async with await Box.connect(server.url, server.token) as box:
            assert await _served(box, "snapshot.delete")
            with pytest.raises(SandboxerError) as e:
                await box.restore("s-0000000000000000")
            return e.value
    err = run(go(), 30)
    assert err.code != "unknown_op" and err.message


def test_export_then_import_gives_back_the_same_snapshot(server):
    async def go():
        async with await Box.connect(server.url, server.token) as box:
            sid = (await box.checkpoint("moved"))["snapshot"]
            archive = await box.export_snapshot(sid)
            await box.delete_snapshot(sid)
            gone = sid not in [s["id"] for s in await box.snapshots()]
            back = await box.import_snapshot(archive)
            listed = [s["id"] for s in await box.snapshots()]
            with pytest.raises(SandboxerError) as bad:
                await box.import_snapshot(archive[: len(archive) // 2])
            return sid, archive, gone, back, listed, bad.value
    sid, archive, gone, back, listed, bad = run(go(), 90)
    # The id is the hash of the archive's first entry, manifest.json (format 3).
    tar = subprocess.run(["zstd", "-d", "-q", "-c"], input=archive, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        first = t.next()
        manifest = t.extractfile(first).read()
    assert first.name == "manifest.json" and json.loads(manifest)["format_version"] == 3
    assert "s-" + hashlib.sha256(manifest).hexdigest()[:16] == sid
    assert gone and back["snapshot"] == sid and back["existing"] is False and sid in listed
    assert bad.code == "bad_snapshot" and "refused" in bad.message


# An agent holding 4 MiB it never changes: two snapshots share nearly all their chunks, which a
# few hundred KiB of snapshot (the waiting probe's) are too small to show reliably (the chunks'
# boundaries fall where they fall: a delta of it was as often larger as smaller than the whole).
HOLDER = ["python3", "-c", "import os, time; b = os.urandom(4 << 20); print('ready', flush=True); time.sleep(600)"]


def test_a_delta_against_a_base_the_box_has_makes_the_same_snapshot(make_server):
    server = make_server(HOLDER)
    server.wait_event(lambda e: e["type"] == "proc.output" and "ready" in e.get("data", ""), timeout=30)

    async def go():
        async with await Box.connect(server.url, server.token) as box:
            a = (await box.checkpoint("a"))["snapshot"]
            b = (await box.checkpoint("b"))["snapshot"]
            whole = await box.export_snapshot(b)
            delta = await box.export_snapshot(b, base=a)
            await box.delete_snapshot(b)
            back = await box.import_snapshot(delta)
            listed = [s["id"] for s in await box.snapshots()]
            return a, b, whole, delta, back, listed
    a, b, whole, delta, back, listed = run(go(), 120)
    assert delta.startswith(b"SBXDELTA") and len(delta) < len(whole) // 4, (len(delta), len(whole))
    assert back["snapshot"] == b and back["base"] == a and back["existing"] is False and b in listed


def test_an_idle_box_becomes_the_copy_restored_with_an_index(server, make_server):
    idle = make_server([], ["--idle"])

    async def go():
        async with await Box.connect(server.url, server.token) as box:
            sid = (await box.checkpoint("moved"))["snapshot"]
            archive = await box.export_snapshot(sid)
            # A box with an agent of its own gains a branch only without an index.
            with pytest.raises(SandboxerError) as busy:
                await box.restore(sid, index=1)
        async with await Box.connect(idle.url, idle.token) as other:
            await other.import_snapshot(archive)
            return busy.value, await other.restore(sid, index=3)
    busy, reply = run(go(), 90)
    assert busy.code == "not_idle" and "idle" in busy.message
    assert [(c["branch"], c["index"]) for c in reply["copies"]] == [("main", 3)], reply


def test_fork_of_a_branch_names_its_snapshot_and_a_bad_call_is_refused_before_sending(make_server):
    server = make_server(HOLDER)
    server.wait_event(lambda e: e["type"] == "proc.output" and "ready" in e.get("data", ""), timeout=30)

    async def go():
        async with await Box.connect(server.url, server.token) as box:
            r = await box.fork(branch="main", n=1, name="sdk-fork")
            listed = {s["id"]: s for s in await box.snapshots()}
            with pytest.raises(ValueError):
                await box.fork("s-0000000000000000", branch="main")
            with pytest.raises(ValueError):
                await box.fork()
            with pytest.raises(ValueError):
                await box.fork("s-0000000000000000", name="x")
            return r, listed
    r, listed = run(go(), 90)
    assert r["ok"] and len(r["copies"]) == 1 and r["snapshot"] in listed
    assert listed[r["snapshot"]]["name"] == "sdk-fork"


def test_names_that_are_not_utf8_are_kept_by_a_checkpoint_a_fork_and_an_export(server, make_server):
    """A name is any bytes but '/' and NUL. Before, a checkpoint of a box holding a name with a byte
    past 0x7f failed ("Can't translate pathname ... to UTF-8", libarchive in the C locale), which
    an agent could use to make every checkpoint of its box fail. Now the tar holds the bytes as
    they are, and the manifest lists such a path by its bytes (files_b64) and a symlink's text
    likewise (target_b64); a UTF-8 name stays in `files`."""
    idle = make_server([], ["--idle"])
    files = {b"/workspace/d\xfe/f\xe9": b"latin-1", "/workspace/café": b"utf-8", b"/tmp/t\xff": b"in tmp"}

    async def go():
        async with await Box.connect(server.url, server.token) as box:
            await box.fs.mkdir(b"/workspace/d\xfe")
            for path, data in files.items():
                await box.fs.write(path, data)
            await box.fs.symlink(b"/workspace/l\xff", b"d\xfe/f\xe9")
            sid = (await box.checkpoint("names"))["snapshot"]
            branch = (await box.fork(sid, 1))["copies"][0]["branch"]
            in_copy = {p: await box.fs.read(p, branch=branch) for p in files}
            through = await box.fs.read(b"/workspace/l\xff", branch=branch)
            archive = await box.export_snapshot(sid)
        async with await Box.connect(idle.url, idle.token) as other:
            await other.import_snapshot(archive)
            await other.restore(sid, index=0)
            elsewhere = {p: await other.fs.read(p) for p in files}
        return sid, in_copy, through, archive, elsewhere
    sid, in_copy, through, archive, elsewhere = run(go(), 120)
    assert in_copy == files and elsewhere == files and through == b"latin-1"
    tar = subprocess.run(["zstd", "-d", "-q", "-c"], input=archive, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar), encoding="utf-8", errors="surrogateescape") as t:
        manifest = json.loads(t.extractfile(t.next()).read())
        names = {m.name.encode("utf-8", "surrogateescape") for m in t.getmembers()}
    by_bytes = {base64.b64decode(k): v for k, v in manifest["files_b64"].items()}
    assert b"fs/workspace/d\xfe/f\xe9" in by_bytes and b"fs/workspace/d\xfe/f\xe9" in names
    assert base64.b64decode(by_bytes[b"fs/workspace/l\xff"]["target_b64"]) == b"d\xfe/f\xe9"
    assert "fs/workspace/café" in manifest["files"] and not any(b"caf\xc3\xa9" in k for k in by_bytes)
