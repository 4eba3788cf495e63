"""Files over the WebSocket: content in binary frames, paths confined to the branch's roots."""
import asyncio
import base64
import hashlib
import json
import os
import shutil
import stat
import struct
import tempfile

import pytest

from sbxtest import LEASE_AGENT, Session, WsBox, overlayfs_dir, run, wait_for_path, ws_connect

CHUNK = 1 << 20


@pytest.fixture
def box(tmp_path):
    with WsBox(tmp_path, ["sleep", "120"], extra=["--set", "resources.grace=1s"]) as b:
        yield b


def header(rid, offset, last):
    return struct.pack("<IQB", rid, offset, 1 if last else 0)


async def write_file(s, rid, path, data, **fields):
    await s.ws.send(json.dumps({"id": rid, "op": "fs.write", "path": path, **fields}))
    if not data:
        await s.ws.send(header(rid, 0, True))
    for off in range(0, len(data), CHUNK):
        part = data[off:off + CHUNK]
        await s.ws.send(header(rid, off, off + len(part) >= len(data)) + part)
    return await s.reply(rid, 120)


async def send_half(s, rid, path, **fields):
    """An upload cut off: two of its four frames sent, the next request answered after them
    (the caller then closes the connection)."""
    await s.ws.send(json.dumps({"id": rid, "op": "fs.write", "path": path, **fields}))
    for off in (0, CHUNK):
        await s.ws.send(header(rid, off, False) + os.urandom(CHUNK))
    assert (await s.request("ping"))["ok"]


async def read_file(s, rid, path):
    r = await s.request("fs.read", id=rid, path=path)
    if not r["ok"]:
        return r, None
    buf = bytearray()
    while True:
        m = await s.ws.recv()
        assert isinstance(m, bytes), m
        i, off, flags = struct.unpack("<IQB", m[:13])
        assert i == rid and off == len(buf)
        buf += m[13:]
        if flags & 1:
            return r, bytes(buf)


def test_a_100_mb_file_round_trips_with_its_checksum(box):
    data = os.urandom(1 << 20) * 100
    want = hashlib.sha256(data).hexdigest()

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            w = await write_file(s, 10, "/workspace/big.bin", data)
            assert w["ok"] and w["size"] == len(data)
            r, got = await read_file(s, 11, "/workspace/big.bin")
            assert r["size"] == len(data)
            return got
    got = run(go(), 180)
    assert hashlib.sha256(got).hexdigest() == want
    assert hashlib.sha256((box.workspace / "big.bin").read_bytes()).hexdigest() == want


def test_an_empty_file_round_trips(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            assert (await write_file(s, 1, "empty", b""))["ok"]
            r, got = await read_file(s, 2, "/workspace/empty")
            assert r["size"] == 0 and got == b""
    run(go(), 30)


def test_list_stat_mkdir_remove(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            assert (await s.request("fs.mkdir", path="/workspace/d"))["ok"]
            assert (await s.request("fs.write", path="/workspace/d/a.txt", data="hello"))["size"] == 5
            st = await s.request("fs.stat", path="d/a.txt")
            assert st["type"] == "file" and st["size"] == 5
            ls = await s.request("fs.list", path="/workspace/d")
            assert ls["ok"], ls
            assert [e["name"] for e in ls["entries"]] == ["a.txt"]
            assert ls["entries"][0]["mode"] == st["mode"] and "name_b64" not in ls["entries"][0]
            bad = await s.request("fs.remove", path="/workspace/d")
            assert bad["ok"] is False and bad["error"]["code"] == "not_empty"
            assert (await s.request("fs.remove", path="/workspace/d", recursive=True))["ok"]
            gone = await s.request("fs.stat", path="/workspace/d")
            assert gone["error"]["code"] == "not_found"
    run(go(), 30)


def test_list_in_pages_gives_every_name_once_in_byte_order(box):
    # A directory an agent filled: fs.list with a limit answers a page at a time (its names past
    # `after`, sorted), so that no one reply holds the whole directory.
    d = box.workspace / "many"
    d.mkdir()
    names = [f"n{i:05d}".encode() for i in range(2500)] + [b"caf\xe9", b"\xff\xfe", b"z-last"]
    for n in names:
        with open(os.path.join(os.fsencode(d), n), "wb") as f:
            f.write(b"x")
    os.symlink(b"n00000", os.path.join(os.fsencode(d), b"link"))
    names.append(b"link")

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            pages, after = [], None
            while True:
                req = {"path": "/workspace/many", "limit": 1000}
                if after is not None:
                    req |= {"after_b64": base64.b64encode(after).decode()}
                r = await s.request("fs.list", **req)
                assert r["ok"], r
                pages.append(r)
                if not r["more"]:
                    return pages
                e = r["entries"][-1]
                after = base64.b64decode(e["name_b64"]) if "name_b64" in e else e["name"].encode()
                assert len(pages) < 10

    pages = run(go(), 60)
    assert [len(p["entries"]) for p in pages] == [1000, 1000, 504]
    got = [base64.b64decode(e["name_b64"]) if "name_b64" in e else e["name"].encode()
           for p in pages for e in p["entries"]]
    assert got == sorted(names)  # each once, in byte order
    by_name = {e.get("name"): e for p in pages for e in p["entries"]}
    assert by_name["link"]["type"] == "symlink" and by_name["link"]["target"] == "n00000"
    assert by_name["n00007"]["type"] == "file" and by_name["n00007"]["size"] == 1


def test_pages_on_connections_of_their_own_see_the_directory_change_between_them(box):
    # As the CLI asks: each page on a new connection, two listings of one directory interleaved.
    # What was read for a page serves the next only while the directory is unchanged: a name made
    # past the cursor between pages is given, one removed is not.
    d = box.workspace / "grow"
    d.mkdir()
    names = [f"n{i:04d}" for i in range(1200)]
    for n in names:
        (d / n).write_bytes(b"")

    async def page(after):
        async with ws_connect(box) as ws:
            req = {"path": "/workspace/grow", "limit": 100} | ({"after": after} if after else {})
            r = await Session(ws).request("fs.list", **req)
            assert r["ok"], r
            return [e["name"] for e in r["entries"]], r["more"]

    async def go():
        got = {"a": [], "b": []}
        more = {"a": True, "b": True}
        step = 0
        while more["a"] or more["b"]:
            for k in ("a", "b"):
                if more[k]:
                    entries, more[k] = await page(got[k][-1] if got[k] else None)
                    got[k] += entries
            step += 1
            if step == 3:
                (d / "n0999x").write_bytes(b"")  # past both cursors
                (d / "n1100").unlink()
            assert step < 20
        return got

    got = run(go(), 60)
    want = sorted(set(names) - {"n1100"} | {"n0999x"})
    assert got["a"] == want and got["b"] == want


def test_rename_moves_the_entry_within_its_root(box):
    (box.workspace / "sub").mkdir()
    (box.workspace / "in-link").symlink_to("sub")  # a symlinked directory that stays inside
    (box.workspace / "link-out").symlink_to("/etc")
    (box.workspace / "abs-link").symlink_to("/etc/passwd")
    passwd = open("/etc/passwd").read()

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)

            async def rename(frm, to, **kw):
                return await s.request("fs.rename", **{"from": frm, "to": to}, **kw)

            def refused(r, code, *names):
                assert r["ok"] is False and r["error"]["code"] == code, r
                for n in names:
                    assert n in r["error"]["message"], r
            await s.request("fs.write", path="/workspace/a.txt", data="A")
            await s.request("fs.write", path="/workspace/b.txt", data="B")
            assert (await rename("/workspace/a.txt", "c.txt"))["ok"]
            refused(await s.request("fs.stat", path="/workspace/a.txt"), "not_found")
            # An entry at the target stays unless asked to be replaced.
            refused(await rename("c.txt", "/workspace/b.txt"), "exists", "/workspace/b.txt", "replace")
            assert (await read_file(s, 7, "/workspace/b.txt"))[1] == b"B"
            assert (await rename("c.txt", "/workspace/b.txt", replace=True))["ok"]
            assert (await read_file(s, 8, "/workspace/b.txt"))[1] == b"A"
            # Directories move with what they hold, also through a symlink that stays inside.
            await s.request("fs.mkdir", path="/workspace/d")
            await s.request("fs.write", path="/workspace/d/f", data="F")
            assert (await rename("/workspace/d", "/workspace/in-link/d2"))["ok"]
            assert (await read_file(s, 9, "/workspace/sub/d2/f"))[1] == b"F"
            refused(await rename("/workspace/sub", "/workspace/sub/d2/inner"), "bad_request", "into itself")
            # Even with replace, what is there must fit: no file over a directory, no directory
            # over one that holds anything.
            await s.request("fs.mkdir", path="/workspace/e")
            refused(await rename("/workspace/b.txt", "/workspace/e", replace=True), "is_a_directory", "/workspace/e")
            refused(await rename("/workspace/e", "/workspace/sub", replace=True), "not_empty", "/workspace/sub")
            assert (await s.request("fs.remove", path="/workspace/e"))["ok"]
            # Nothing leaves its root, or reaches out of it.
            refused(await rename("/workspace/b.txt", "/tmp/b.txt"), "cross_root", "/tmp/b.txt")
            refused(await rename("/workspace/link-out/passwd", "/workspace/p"), "path_escape")
            refused(await rename("/workspace/b.txt", "/workspace/link-out/b.txt"), "path_escape")
            refused(await rename("/workspace/../../etc/passwd", "/workspace/p"), "path_escape")
            refused(await rename("/workspace", "/workspace/w"), "bad_request", "names no entry")
            refused(await rename("/workspace/b.txt", "/workspace/.."), "bad_request", "names no entry")
            refused(await rename("/workspace/nothing", "/workspace/x"), "not_found", "/workspace/nothing")
            refused(await rename("/workspace/b.txt", "/workspace/no-dir/x"), "not_found", "/workspace/no-dir/x")
            refused(await s.request("fs.rename", to="/workspace/x"), "bad_request", "from")
            # A symlink moves as itself; what it names is not touched.
            assert (await rename("/workspace/abs-link", "/workspace/moved-link"))["ok"]
            # The agent sees the moves.
            await s.request("subscribe", since=0)
            await s.request("exec", proc="cat", argv=["cat", "/workspace/sub/d2/f", "/workspace/b.txt"])
            # Its output may come in more than one event: all of it is in before its exit.
            await s.wait_event(lambda e: e.get("proc") == "cat" and e["type"] == "proc.exited")
            assert "".join(e["data"] for e in s.events if e.get("proc") == "cat" and e["type"] == "proc.output") == "FA"
    run(go(), 30)
    assert os.readlink(box.workspace / "moved-link") == "/etc/passwd"
    assert not os.path.lexists(box.workspace / "abs-link")
    assert open("/etc/passwd").read() == passwd


def test_the_agent_sees_files_written_over_the_socket(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            await s.request("subscribe", since=0)
            await s.request("fs.write", path="/workspace/note", data="from outside\n")
            await s.request("exec", proc="cat", argv=["cat", "/workspace/note"])
            e = await s.wait_event(lambda e: e.get("proc") == "cat" and e["type"] == "proc.output")
            assert e["data"] == "from outside\n"
    run(go(), 30)


ESCAPES = [
    "/workspace/../../../../etc/passwd",
    "../etc/passwd",
    "/etc/passwd",
    "/workspace/link-out/passwd",
    "/workspace/abs-link",
    "/proc/self/root/etc/passwd",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_path_escapes_are_refused(box, path):
    (box.workspace / "link-out").symlink_to("/etc")
    (box.workspace / "abs-link").symlink_to("/etc/passwd")

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            r = await s.request("fs.read", path=path)
            assert r["ok"] is False and r["error"]["code"] == "path_escape", r
            w = await s.request("fs.write", path=path, data="x")
            assert w["ok"] is False and w["error"]["code"] in ("path_escape", "not_found"), w
    run(go(), 30)
    assert "x" != open("/etc/passwd").read()[:1]


@pytest.mark.parametrize("path", ["/workspace/link-out/passwd", "/workspace/abs-link", "/workspace/../../etc/passwd"])
def test_chmod_and_symlink_outside_the_roots_are_refused(box, path):
    (box.workspace / "link-out").symlink_to("/etc")
    (box.workspace / "abs-link").symlink_to("/etc/passwd")
    before = os.stat("/etc/passwd").st_mode

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            r = await s.request("fs.chmod", path=path, mode=0o777)
            assert r["ok"] is False and r["error"]["code"] == "path_escape", r
            # A new link in a directory reached through a link out, or by `..`.
            r = await s.request("fs.symlink", path=path.replace("abs-link", "link-out/passwd") + "-new", target="x")
            assert r["ok"] is False and r["error"]["code"] == "path_escape", r
    run(go(), 30)
    assert os.stat("/etc/passwd").st_mode == before
    assert not os.path.lexists("/etc/passwd-new")


def test_symlink_chmod_and_mkdir_mode_as_the_host_sees_them(box):
    os.symlink(b"caf\xe9", os.fsencode(box.workspace / "latin1-link"))

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            for mode in (0o700, 0o555, 0o2750):
                assert (await s.request("fs.mkdir", path=f"/workspace/m{mode:o}", mode=mode))["ok"]
            assert (await s.request("fs.mkdir", path="/workspace/m700", mode=0o777))["ok"]  # there: kept
            assert (await s.request("fs.write", path="/workspace/f", data="hello"))["ok"]
            assert (await s.request("fs.chmod", path="/workspace/f", mode=0o751))["ok"]
            for target in ("f", "/etc/passwd", "../../nowhere", "dangling"):
                name = "l-" + target.replace("/", "_")
                assert (await s.request("fs.symlink", path=f"/workspace/{name}", target=target))["ok"]
            again = await s.request("fs.symlink", path="/workspace/f", target="x")
            assert again["error"]["code"] == "exists" and "/workspace/f" in again["error"]["message"], again
            long = await s.request("fs.symlink", path="/workspace/long", target="a" * 4096)
            assert long["error"]["code"] == "bad_request" and "4096 bytes" in long["error"]["message"], long
            nul = await s.request("fs.symlink", path="/workspace/nul", target="a\u0000b")
            assert nul["error"]["code"] == "bad_request" and "NUL" in nul["error"]["message"], nul
            # Through an inside link: what it names, within the root.
            assert (await s.request("fs.chmod", path="/workspace/l-f", mode=0o640))["ok"]
            # A link the API made to a host path is stored, never followed out of the root.
            out = await s.request("fs.read", path="/workspace/l-_etc_passwd")
            assert out["error"]["code"] == "path_escape", out
            return {e["name"]: e for e in (await s.request("fs.list", path="/workspace"))["entries"]}
    entries = run(go(), 30)
    w = box.workspace
    for mode in (0o700, 0o555, 0o2750):
        assert stat.S_IMODE(os.lstat(w / f"m{mode:o}").st_mode) == mode
        assert entries[f"m{mode:o}"]["mode"] == mode
    assert stat.S_IMODE(os.lstat(w / "f").st_mode) == 0o640 and entries["f"]["mode"] == 0o640
    assert os.readlink(w / "l-_etc_passwd") == "/etc/passwd" and os.readlink(w / "l-dangling") == "dangling"
    assert entries["l-.._.._nowhere"] == {"name": "l-.._.._nowhere", "type": "symlink", "size": 13,
                                           "mode": 0o777, "target": "../../nowhere"}
    assert "target" not in entries["f"] and "target_b64" not in entries["l-f"]
    latin = entries["latin1-link"]
    assert latin["target"] == "caf\ufffd" and base64.b64decode(latin["target_b64"]) == b"caf\xe9"
    assert not os.path.lexists(w / "long") and not os.path.lexists(w / "nul")


def test_stat_without_follow_names_the_link_itself_and_its_text(box):
    w = box.workspace
    (w / "d").mkdir()
    (w / "d/f").write_text("12345")
    (w / "lf").symlink_to("d/f")
    (w / "out").symlink_to("/etc/passwd")
    os.symlink(b"caf\xe9", os.fsencode(w / "latin"))

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            # The control: followed (the default), the file it names.
            r = await s.request("fs.stat", path="/workspace/lf")
            assert r["type"] == "file" and r["size"] == 5 and "target" not in r, r
            r = await s.request("fs.stat", path="/workspace/lf", follow=False)
            assert r["type"] == "symlink" and r["target"] == "d/f" and r["size"] == 3, r
            # A link out of the roots is named, never followed (its text is what fs.list gives).
            r = await s.request("fs.stat", path="/workspace/out")
            assert r["ok"] is False and r["error"]["code"] == "path_escape", r
            r = await s.request("fs.stat", path="/workspace/out", follow=False)
            assert r["type"] == "symlink" and r["target"] == "/etc/passwd", r
            r = await s.request("fs.stat", path="/workspace/latin", follow=False)
            assert r["target"] == "caf\ufffd" and base64.b64decode(r["target_b64"]) == b"caf\xe9", r
            # Anything else as it is; a root, and a path ending in '/', are followed (as lstat).
            assert (await s.request("fs.stat", path="/workspace/d/f", follow=False))["type"] == "file"
            assert (await s.request("fs.stat", path="/workspace", follow=False))["type"] == "dir"
            r = await s.request("fs.stat", path="/workspace/nothing", follow=False)
            assert r["error"]["code"] == "not_found", r
            r = await s.request("fs.stat", path="/workspace/d/..", follow=False)
            assert r["error"]["code"] == "bad_request", r
            r = await s.request("fs.stat", path="/workspace/out/../../etc", follow=False)
            assert r["error"]["code"] == "path_escape", r
    run(go(), 30)


def test_a_name_that_is_not_utf8_is_named_by_its_bytes_in_path_b64(box):
    w = os.fsencode(box.workspace)
    with open(w + b"/caf\xe9.txt", "wb") as f:
        f.write(b"latin")
    b64 = lambda b: base64.b64encode(b).decode()
    name = b64(b"/workspace/caf\xe9.txt")

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            entries = (await s.request("fs.list", path="/workspace"))["entries"]
            listed = [e for e in entries if "name_b64" in e]
            assert [base64.b64decode(e["name_b64"]) for e in listed] == [b"caf\xe9.txt"], entries
            # The control: the name as text (U+FFFD for the byte) names no such file.
            r = await s.request("fs.stat", path="/workspace/caf\ufffd.txt")
            assert r["error"]["code"] == "not_found", r
            r = await s.request("fs.stat", path_b64=name)
            assert r["type"] == "file" and r["size"] == 5, r
            assert r["path"] == "/workspace/caf\ufffd.txt" and base64.b64decode(r["path_b64"]) == b"/workspace/caf\xe9.txt"
            r = await s.request("fs.read", id=7, path_b64=name)
            assert r["ok"] and r["size"] == 5, r
            m = await s.ws.recv()
            assert m[13:] == b"latin"
            w_ = await s.request("fs.write", path_b64=b64(b"/workspace/new\xff"), data="made")
            assert w_["ok"] and base64.b64decode(w_["path_b64"]) == b"/workspace/new\xff", w_
            assert (await s.request("fs.chmod", path_b64=b64(b"/workspace/new\xff"), mode=0o600))["ok"]
            assert (await s.request("fs.mkdir", path_b64=b64(b"/workspace/d\xfe"), mode=0o700))["ok"]
            assert (await s.request("fs.symlink", path_b64=b64(b"/workspace/d\xfe/l\xfd"), target="x"))["ok"]
            assert (await s.request("fs.rename", from_b64=name, to_b64=b64(b"/workspace/d\xfe/caf\xe9")))["ok"]
            assert (await s.request("fs.remove", path_b64=b64(b"/workspace/new\xff")))["ok"]
            # One of the two; base64 that decodes; and the bytes are checked as any path is.
            r = await s.request("fs.stat", path="/workspace", path_b64=name)
            assert r["error"]["code"] == "bad_request" and "not both" in r["error"]["message"], r
            r = await s.request("fs.stat", path_b64="%%%")
            assert r["error"]["code"] == "bad_request" and "path_b64" in r["error"]["message"], r
            r = await s.request("fs.read", id=8, path_b64=b64(b"/workspace/../../etc/passwd"))
            assert r["error"]["code"] == "path_escape", r
            r = await s.request("fs.stat", path_b64=b64(b"/workspace/a\x00b"))
            assert r["error"]["code"] == "bad_request" and "NUL" in r["error"]["message"], r
            r = await s.request("fs.stat", path_b64=b64(b"/workspace/gone\xe9"))
            assert r["error"]["code"] == "not_found" and "gone\ufffd" in r["error"]["message"], r
    run(go(), 30)
    assert open(w + b"/d\xfe/caf\xe9", "rb").read() == b"latin"
    assert not os.path.lexists(w + b"/new\xff") and not os.path.lexists(w + b"/caf\xe9.txt")
    assert os.stat(w + b"/d\xfe").st_mode & 0o777 == 0o700 and os.readlink(w + b"/d\xfe/l\xfd") == b"x"


def test_control_a_symlink_inside_the_workspace_is_followed(box):
    (box.workspace / "real.txt").write_text("inside")
    (box.workspace / "link.txt").symlink_to("real.txt")

    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            r, got = await read_file(s, 3, "/workspace/link.txt")
            assert got == b"inside"
    run(go(), 30)


@pytest.mark.parametrize("mode", ["overlay", "state-dir-on-overlayfs", "flat"])
def test_the_file_ops_see_the_agents_own_tmp(tmp_path, mode):
    # The agent's /tmp is a mount of its own mount namespace: an overlay on the host's /tmp (its
    # files in tmp-upper/), or, on a state dir on overlayfs, a bind of tmp/. fs.read, fs.list and
    # fs.stat see what the agent wrote there, and what fs.write writes, the agent reads. The file
    # ops once took tmp/ itself, which the overlay leaves unused: not found, and unseen. Without
    # namespaces the agent's /tmp is the host's, and so is the ops': here a directory of the test's
    # own in it (`base`), which the ops once missed in the same way.
    base = "/tmp"

    async def go(box):
        async with ws_connect(box) as ws:
            s = Session(ws)
            await s.request("subscribe", since=0)
            await s.request("exec", proc="mk", argv=["sh", "-c", f"echo from-agent > {base}/agent.txt; echo done"])
            await s.wait_event(lambda e: e.get("proc") == "mk" and e["type"] == "proc.exited")
            r, got = await read_file(s, 7, f"{base}/agent.txt")
            assert r["ok"] and got == b"from-agent\n", r
            names = [e["name"] for e in (await s.request("fs.list", path=base))["entries"]]
            assert "agent.txt" in names, names
            assert (await s.request("fs.stat", path=f"{base}/agent.txt"))["size"] == len(got)
            assert (await s.request("fs.write", path=f"{base}/op.txt", data="from-outside\n"))["ok"]
            await s.request("exec", proc="cat", argv=["cat", f"{base}/op.txt"])
            e = await s.wait_event(lambda e: e.get("proc") == "cat" and e["type"] in ("proc.output", "proc.exited"))
            assert e.get("data") == "from-outside\n", e
            # The agent's links out of its /tmp lead nowhere: not to its root, not to the host's.
            await s.request("exec", proc="ln", argv=["sh", "-c", f"ln -s / {base}/out; ln -s /etc/passwd {base}/abs"])
            await s.wait_event(lambda e: e.get("proc") == "ln" and e["type"] == "proc.exited")
            for path in (f"{base}/out/etc/passwd", f"{base}/abs", "/tmp/../etc/passwd"):
                r = await s.request("fs.read", path=path)
                assert r["ok"] is False and r["error"]["code"] == "path_escape", (path, r)
                w = await s.request("fs.write", path=path, data="x")
                assert w["ok"] is False and w["error"]["code"] in ("path_escape", "not_found"), (path, w)

    def with_box(state_parent, extra=()):
        (state_parent / "b").mkdir()
        with WsBox(state_parent / "b", ["sleep", "120"], extra=["--set", "resources.grace=1s", *extra]) as box:
            run(go(box), 30)
            return box
    if mode == "overlay":
        box = with_box(tmp_path)
        # The overlay's upper layer holds both; tmp/ holds neither.
        assert sorted(os.listdir(box.state / "branches" / "main" / "tmp")) == []
    elif mode == "flat":
        own = tempfile.mkdtemp(prefix="sbx-flat-tmp-", dir="/tmp")
        base = own
        try:
            box = with_box(tmp_path, ["--set", "isolation.namespaces=false"])
            assert os.path.exists(f"{own}/agent.txt") and os.path.islink(f"{own}/out")
            # The branch's dir has no tmp/ of its own: only the host's /tmp held what was written.
            assert sorted(os.listdir(box.state / "branches" / "main")) == ["workspace"]
        finally:
            shutil.rmtree(own)
    else:
        with overlayfs_dir(tmp_path) as mnt:
            with_box(mnt)


def test_an_upload_that_fills_the_disk_or_is_cut_off_leaves_no_file_it_made(tmp_path):
    # Under an 8M disk ceiling (the workspace and /tmp tmpfs of that size): a 12 MiB upload fails
    # with ENOSPC. The file it made, 8 MiB of it, once stayed and kept the disk full; an upload
    # whose client went away halfway stayed half written. Now both are removed; a file that was
    # there before is written in place and stays as the failed write left it (the control: the
    # server does not remove what it did not make).
    with WsBox(tmp_path, ["sleep", "120"], extra=["--set", "resources.disk=8M", "--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                assert (await write_file(s, 1, "/workspace/old.txt", b"before\n"))["ok"]
                for rid, path in ((2, "/workspace/big.bin"), (3, "/tmp/big.bin"), (4, "/workspace/old.txt")):
                    r = await write_file(s, rid, path, os.urandom(12 << 20))
                    assert not r["ok"] and r["error"]["code"] == "io_error", r
                    assert r["error"]["message"] == f"write {path}: No space left on device", r
                assert (await s.request("fs.stat", path="/workspace/big.bin"))["error"]["code"] == "not_found"
                assert (await s.request("fs.stat", path="/tmp/big.bin"))["error"]["code"] == "not_found"
                st = await s.request("fs.stat", path="/workspace/old.txt")
                assert st["ok"] and 0 < st["size"] < 12 << 20, st
                assert (await s.request("fs.remove", path="/workspace/old.txt"))["ok"]
                # The space is back: 6 MiB fit.
                assert (await write_file(s, 5, "/workspace/fits.bin", os.urandom(6 << 20)))["ok"]
                assert (await s.request("fs.remove", path="/workspace/fits.bin"))["ok"]
                # Cut off: two of four frames, then the connection closes.
                await send_half(s, 6, "/workspace/half.bin")
            async with ws_connect(box) as ws:
                s = Session(ws)
                for _ in range(100):
                    st = await s.request("fs.stat", path="/workspace/half.bin")
                    if not st["ok"]:
                        break
                    await asyncio.sleep(0.05)
                assert st["error"]["code"] == "not_found", st
                # A whole upload of a new file stays.
                assert (await write_file(s, 7, "/workspace/whole.bin", b"x" * (CHUNK + 1)))["ok"]
                assert (await s.request("fs.stat", path="/workspace/whole.bin"))["size"] == CHUNK + 1
        run(go())
        assert box.alive()



def test_an_atomic_write_replaces_the_file_whole_or_leaves_it_as_it_was(tmp_path):
    # fs.write with atomic: a new file beside the old one, renamed over it once written. Under an
    # 8M disk ceiling a 12 MiB write fails (ENOSPC) and one cut off halfway ends: the old file is
    # as it was, and nothing is left beside it (the control, test_an_upload_that_fills_the_disk...
    # above: written in place, the old file stays as the failed write left it). A whole one
    # replaces it, keeping its mode; the agent, holding the old file open, still reads the old.
    agent = ["python3", "-c", "import sys,time\nfor _ in range(600):\n    time.sleep(0.1)\n"
             "    try: f = open('/workspace/old.txt'); break\n    except OSError: pass\n"
             "print('opened', flush=True); time.sleep(3); print('agent read', repr(f.read()), flush=True); "
             "time.sleep(60)"]
    with WsBox(tmp_path, agent, extra=["--set", "resources.disk=8M", "--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                assert (await write_file(s, 1, "/workspace/old.txt", b"before\n"))["ok"]
                assert (await s.request("fs.chmod", path="/workspace/old.txt", mode=0o600))["ok"]
                await asyncio.get_running_loop().run_in_executor(None, lambda: box.wait_event(
                    lambda e: e["type"] == "proc.output" and "opened" in e.get("data", "")))
                r = await write_file(s, 2, "/workspace/old.txt", os.urandom(12 << 20), atomic=True)
                assert not r["ok"] and r["error"] == {
                    "code": "io_error", "message": "write /workspace/old.txt: No space left on device"}, r
                # Cut off: two of four frames, then the connection closes.
                await send_half(s, 3, "/workspace/old.txt", atomic=True)
            async with ws_connect(box) as ws:
                s = Session(ws)
                for _ in range(100):
                    names = [e["name"] for e in (await s.request("fs.list", path="/workspace"))["entries"]]
                    if names == ["old.txt"]:
                        break
                    await asyncio.sleep(0.05)
                assert names == ["old.txt"], names
                r, data = await read_file(s, 104, "/workspace/old.txt")
                assert data == b"before\n", data
                # Whole: replaced, its mode kept; inline too.
                assert (await write_file(s, 105, "/workspace/old.txt", b"after\n" * 1000, atomic=True))["ok"]
                st = await s.request("fs.stat", path="/workspace/old.txt")
                assert st["size"] == 6000 and st["mode"] == 0o600, st
                r = await s.request("fs.write", path="/workspace/new.txt", data="inline", atomic=True, mode=0o640)
                assert r["ok"] and r["size"] == 6, r
                st = await s.request("fs.stat", path="/workspace/new.txt")
                assert st["size"] == 6 and st["mode"] == 0o640, st
                # Refused: with append; over a directory.
                r = await s.request("fs.write", path="/workspace/new.txt", data="x", atomic=True, append=True)
                assert r["error"] == {"code": "bad_request",
                                      "message": "field atomic: not with append (a replacement is whole)"}, r
                assert (await s.request("fs.mkdir", path="/workspace/d"))["ok"]
                r = await s.request("fs.write", path="/workspace/d", data="x", atomic=True)
                assert r["error"] == {"code": "is_a_directory", "message": "/workspace/d: is a directory"}, r
                # A symlink there is neither replaced nor written through (as a FIFO is not opened).
                assert (await s.request("fs.symlink", path="/workspace/link", target="new.txt"))["ok"]
                r = await s.request("fs.write", path="/workspace/link", data="x", atomic=True)
                assert r["error"] == {"code": "not_a_file",
                                      "message": "/workspace/link: not a regular file: a symlink"}, r
                names = sorted(e["name"] for e in (await s.request("fs.list", path="/workspace"))["entries"])
                assert names == ["d", "link", "new.txt", "old.txt"], names
                r, data = await read_file(s, 106, "/workspace/new.txt")
                assert data == b"inline", data
        run(go())
        said = box.wait_event(lambda e: e["type"] == "proc.output" and "agent read" in e.get("data", ""))
        assert "agent read 'before\\n'" in said["data"], said
        assert box.alive()


def test_a_file_the_agent_holds_a_lease_on_is_refused_at_once(tmp_path):
    # An open of a file under a lease waits for the holder to give it up, lease-break-time (45 s
    # by default): fs.read and fs.write opened it so on the loop, and the box answered nobody
    # meanwhile. They fail at once now, with `busy`.
    with WsBox(tmp_path, ["python3", "-c", LEASE_AGENT]) as box:
        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                await wait_for_path(s, "/workspace/ready")
                read = await s.request("fs.read", path="/workspace/leased", timeout=10)
                write = await s.request("fs.write", path="/workspace/leased", size=1, timeout=10)
                stats = await s.request("stats", timeout=5)
                return read, write, stats
        read, write, stats = run(go())
    assert not read["ok"] and read["error"]["code"] == "busy", read
    assert "lease" in read["error"]["message"]
    assert not write["ok"] and write["error"]["code"] == "busy", write
    assert stats["ok"]
