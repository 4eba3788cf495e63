"""Attacks on snapshot import (issue 13, item 6): a client holding a box's token uploads an archive
it crafted. Each archive here is real: a tar made with `tarfile`, compressed with the zstd CLI
(or, for bombs, a zstd frame of RLE blocks written here, so a huge expansion costs nothing to
make), signed (where it is) with the openssl CLI. Each goes through `sandboxer import URL FILE`
into a real box under `sandboxer-init --listen`.

Controls: the extraction attacks (a symlink written earlier in the archive, a bomb) are shown
working against a plain `tarfile.extractall` without filters, the naive extraction the old code
matched; the signature attacks against a box started with --allow-unsigned (the defence off),
which accepts the archive but restores it cold only."""
import base64
import concurrent.futures
import hashlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from sbxtest import CLI, INIT, WsBox, checkpoint_and_export, of_type

# An agent whose memory a live copy keeps: it prints a nonce made at its start, then counts.
COUNTER = ("import os, time\n"
           "nonce = os.urandom(8).hex()\n"
           "n = 0\n"
           "while True:\n"
           "    n += 1\n"
           "    print(nonce, n, flush=True)\n"
           "    time.sleep(0.1)\n")


# ---- making archives ----

def sha256(data):
    return hashlib.sha256(data).hexdigest()


def keypair(path):
    """An Ed25519 key the test owns (not the box's): PEM private key, and the raw public key."""
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(path)], check=True,
                   capture_output=True)
    der = subprocess.run(["openssl", "pkey", "-in", str(path), "-pubout", "-outform", "DER"], check=True,
                         capture_output=True).stdout
    pub = path.with_suffix(".pub")
    subprocess.run(["openssl", "pkey", "-in", str(path), "-pubout", "-out", str(pub)], check=True, capture_output=True)
    return path, der[-32:]


def fingerprint(raw):
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:32]


def signature_json(manifest_bytes, key, tmp):
    import base64
    path, raw = key
    m = tmp / "m.bin"
    m.write_bytes(manifest_bytes)
    sig = subprocess.run(["openssl", "pkeyutl", "-sign", "-inkey", str(path), "-rawin", "-in", str(m)],
                         check=True, capture_output=True).stdout
    return json.dumps({"alg": "ed25519", "key": fingerprint(raw), "public_key": base64.b64encode(raw).decode(),
                       "signature": base64.b64encode(sig).decode()}).encode()


def manifest_of(entries, **fields):
    """A format-2 manifest listing `entries`: (name, kind, data-or-target)."""
    files = {}
    for name, kind, data in entries:
        if kind == "dir":
            files[name] = {"type": "dir"}
        elif kind == "symlink":
            files[name] = {"type": "symlink", "target": data}
        else:
            files[name] = {"type": "file", "size": len(data), "sha256": sha256(data)}
    m = {"format": "sandboxer.checkpoint", "format_version": 2, "box": "b-attacker", "branch": "main", "name": "",
         "parent": None, "profile": "default", "image": None, "mode": "fs", "criu": None,
         "agent": {"argv": ["python3", "-c", "print('cold copy ran', flush=True)"], "cwd": "/workspace"},
         "pipes": {}, "masks": [], "files": files}
    m.update(fields)
    return m


def tar_bytes(members):
    """A tar stream of `members`: (name, kind, data-or-target); regular data is bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, kind, data in members:
            ti = tarfile.TarInfo(name)
            ti.mtime = int(time.time())
            if kind == "dir":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                t.addfile(ti)
            elif kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, data
                t.addfile(ti)
            elif kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, data
                t.addfile(ti)
            else:
                ti.size, ti.mode = len(data), 0o644
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def zstd(data):
    return subprocess.run(["zstd", "-q", "-c", "-3"], input=data, check=True, capture_output=True).stdout


def archive(tmp, entries, *, key=None, manifest=None, extra_members=(), name="a.tar.zst"):
    """A crafted format-2 archive: manifest.json, signature.json (if `key`), then the entries."""
    m = json.dumps(manifest if manifest is not None else manifest_of(entries)).encode() + b"\n"
    members = [("manifest.json", "file", m)]
    if key:
        members.append(("signature.json", "file", signature_json(m, key, tmp)))
    members += list(entries) + list(extra_members)
    path = tmp / name
    path.write_bytes(zstd(tar_bytes(members)))
    return path


def zstd_frame(segments):
    """A zstd frame of raw blocks (bytes segments) and RLE blocks (int segments: that many zero
    bytes), so gigabytes of zeros cost 4 bytes per 128 KiB."""
    out = bytearray(b"\x28\xb5\x2f\xfd")  # magic
    out += bytes([0x00, 0x38])  # no content size, no checksum; window 2^(10+7) = 128 KiB
    blocks = []
    for seg in segments:
        if isinstance(seg, int):
            left = seg
            while left:
                n = min(left, 128 << 10)
                blocks.append((1, n, b"\x00"))
                left -= n
        else:
            for i in range(0, len(seg), 128 << 10):
                chunk = seg[i:i + (128 << 10)]
                blocks.append((0, len(chunk), chunk))
    for i, (kind, size, payload) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        header = last | (kind << 1) | (size << 3)
        out += header.to_bytes(3, "little") + payload
    return bytes(out)


def tar_header(name, size):
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, 0o644, int(time.time())
    return ti.tobuf(format=tarfile.PAX_FORMAT)


def bomb_segments(tmp, key, *, listed, actual, trailing=0):
    """The tar stream of a bomb as segments: fs/big listed with `listed` zero bytes in the signed
    manifest, its tar header saying `actual` (all zeros); `trailing` zeros after the tar's end."""
    entries = [("fs", "dir", None), ("fs/big", "file", b"\0" * listed)]
    m = json.dumps(manifest_of(entries)).encode() + b"\n"
    head = b""  # the members with no end-of-archive blocks after them
    for name, data in (("manifest.json", m), ("signature.json", signature_json(m, key, tmp))):
        head += tar_header(name, len(data)) + data + bytes((512 - len(data) % 512) % 512)
    d = tarfile.TarInfo("fs")
    d.type, d.mode = tarfile.DIRTYPE, 0o755
    head += d.tobuf(format=tarfile.PAX_FORMAT)
    pad = (512 - actual % 512) % 512
    return [head + tar_header("fs/big", actual), actual + pad + 1024 + trailing]


# ---- the box ----

def env_with_keys(tmp):
    """An environment whose per-user key pair (made on first use) is this test's own."""
    return dict(os.environ, XDG_STATE_HOME=str(tmp / "xdg"))


def start(tmp, name, *extra, argv=("sleep", "600"), env=None):
    d = tmp / name
    d.mkdir()
    return WsBox(d, list(argv), extra=list(extra), env=env or env_with_keys(tmp))


def sbx_import(box, path, *extra):
    r = subprocess.run([str(CLI), "import", box.url, str(path), "--json", "--token-file", str(box.token_file), *extra],
                       capture_output=True, text=True, timeout=120)
    return r


def leftovers(box):
    """What the snapshot store holds beyond filed snapshots (temporary files and dirs)."""
    d = box.state / "snapshots"
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".")) if d.exists() else []


def events(box, type_):
    return of_type(box.read_events(), type_)


def wait_for(fn, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    return fn()


# ---- (a) extraction through a symlink the archive wrote ----

def symlink_attack(tmp, outside):
    return [("fs", "dir", None), ("fs/a", "symlink", str(outside)), ("fs/a/x", "file", b"written outside\n")]


def test_symlink_entry_then_a_file_through_it_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    attacker = keypair(tmp_path / "attacker.pem")
    # Even an archive the box trusts (its signer given with --trust-key) cannot write outside.
    path = archive(tmp_path, symlink_attack(tmp_path, outside), key=attacker)
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0, r.stdout
        assert "its directory fs/a comes later or not at all" in r.stderr, r.stderr
        assert list(outside.iterdir()) == []
        assert leftovers(box) == [] and not list((box.state / "snapshots").glob("*.d"))


def test_control_symlink_attack_works_against_naive_extraction(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    data = tar_bytes(symlink_attack(tmp_path, outside))
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        t.extractall(tmp_path / "naive", **kw)
    assert (outside / "x").read_bytes() == b"written outside\n"


@pytest.mark.parametrize("name,entries,reason", [
    ("dotdot", [("fs", "dir", None), ("fs/../../escaped", "file", b"x")], "unsafe path: fs/../../escaped"),
    ("absolute", [("/tmp/sbx-escaped", "file", b"x")], "unsafe path: /tmp/sbx-escaped"),
])
def test_paths_leaving_the_tree_are_refused(tmp_path, name, entries, reason):
    attacker = keypair(tmp_path / "attacker.pem")
    path = archive(tmp_path, entries, key=attacker)
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0 and reason in r.stderr, r.stderr
        assert not (box.state / "escaped").exists() and not pathlib.Path("/tmp/sbx-escaped").exists()


def test_a_refusal_naming_bytes_that_are_not_utf8_reaches_the_client_as_text(tmp_path):
    """The manifest lists a path by its bytes (files_b64); a refusal quotes it. Before, the reply
    carried the raw byte and every client's parser refused the frame (sdk/cpp closes with 1007):
    the error never reached the user. Now it has U+FFFD for the byte (base::json_text), and the
    journal stays UTF-8 (read_events decodes it strictly)."""
    attacker = keypair(tmp_path / "attacker.pem")
    name = b"fs/\xff/../../escaped"
    m = manifest_of([("fs", "dir", None)])
    m["files_b64"] = {base64.b64encode(name).decode(): {"type": "file", "size": 1, "sha256": sha256(b"x")}}
    path = archive(tmp_path, [("fs", "dir", None), (name.decode("utf-8", "surrogateescape"), "file", b"x")],
                   key=attacker, manifest=m)
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0, r.stdout
        assert "the archive's manifest lists an unsafe path: fs/\ufffd/../../escaped" in r.stderr, r.stderr
        assert sbx_import(box, archive(tmp_path, [("fs", "dir", None)], key=attacker, name="ok.tar.zst")).returncode == 0
        box.read_events()
        assert not (box.state / "escaped").exists()


def test_a_hard_link_entry_is_refused(tmp_path):
    attacker = keypair(tmp_path / "attacker.pem")
    entries = [("fs", "dir", None), ("fs/shadow", "file", b"")]
    m = manifest_of(entries)
    path = archive(tmp_path, [("fs", "dir", None)], key=attacker, manifest=m,
                   extra_members=[("fs/shadow", "hardlink", "/etc/shadow")])
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0 and "hard link (fs/shadow)" in r.stderr, r.stderr


def links_archive(tmp, key, entries, *, version=4):
    """A crafted archive of `entries` whose "hardlink" members its manifest lists as hard links (the
    format-4 entry a checkpoint writes for a further name of an inode), in the order given."""
    m = manifest_of([e for e in entries if e[1] != "hardlink"], format_version=version)
    for name, kind, target in entries:
        if kind == "hardlink":
            m["files"][name] = {"type": "hardlink", "target": target}
    return archive(tmp, entries, key=key, manifest=m, name=f"links-{version}.tar.zst")


def link_to_outside(tmp):
    victim = tmp / "victim"
    victim.write_bytes(b"the host's file\n")
    return victim, [("fs", "dir", None), ("fs/l", "hardlink", str(victim))]


@pytest.mark.parametrize("case", ["outside", "a directory", "before its file", "in format 3"])
def test_a_hard_link_entry_leaving_the_layers_files_is_refused(tmp_path, case):
    """A format-4 archive may hold a hard link entry, to a file of the layer extracted before it:
    not to a path outside (the naive extraction of the control below links the host's file), nor
    a directory, nor a file that comes after it; and a format-3 manifest lists none."""
    victim, entries = link_to_outside(tmp_path)
    reason = f"the manifest's entry for fs/l links to {victim}, not a file of the layer"
    version = 4
    if case == "a directory":
        entries = [("fs", "dir", None), ("fs/d", "dir", None), ("fs/l", "hardlink", "fs/d")]
        reason = "the archive's hard link fs/l names fs/d, which is not a file it holds before it"
    elif case == "before its file":
        entries = [("fs", "dir", None), ("fs/l", "hardlink", "fs/f"), ("fs/f", "file", b"x")]
        reason = "the archive's hard link fs/l names fs/f, which is not a file it holds before it"
    elif case == "in format 3":
        entries = [("fs", "dir", None), ("fs/f", "file", b"x"), ("fs/l", "hardlink", "fs/f")]
        reason, version = "the manifest's entry for fs/l is a hard link, which a format-3 archive does not hold", 3
    attacker = keypair(tmp_path / "attacker.pem")
    path = links_archive(tmp_path, attacker, entries, version=version)
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0 and reason in r.stderr, r.stderr
        assert victim.stat().st_nlink == 1
        assert leftovers(box) == [] and not list((box.state / "snapshots").glob("*.d"))


def test_control_a_hard_link_to_a_file_of_the_layer_is_imported_and_naive_extraction_links_outside(tmp_path):
    attacker = keypair(tmp_path / "attacker.pem")
    path = links_archive(tmp_path, attacker, [("fs", "dir", None), ("fs/f", "file", b"x"), ("fs/l", "hardlink", "fs/f")])
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        r = sbx_import(box, path)
        assert r.returncode == 0, r.stderr
    victim, entries = link_to_outside(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes(entries))) as t:
        kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        t.extractall(tmp_path / "naive", **kw)
    assert (tmp_path / "naive/fs/l").stat().st_ino == victim.stat().st_ino


# ---- (b) decompression bombs ----

def test_a_bomb_in_an_entry_is_refused_at_its_header_quickly(tmp_path):
    attacker = keypair(tmp_path / "attacker.pem")
    segs = bomb_segments(tmp_path, attacker, listed=1024, actual=16 << 30)
    path = tmp_path / "bomb.tar.zst"
    path.write_bytes(zstd_frame(segs))
    assert path.stat().st_size < 1 << 20  # 16 GiB of zeros in well under 1 MiB
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        t0 = time.monotonic()
        r = sbx_import(box, path)
        assert time.monotonic() - t0 < 20
        assert r.returncode != 0, r.stdout
        assert f"fs/big is {16 << 30} bytes, its manifest says 1024" in r.stderr, r.stderr
        du = sum(p.stat().st_size for p in box.state.rglob("*") if p.is_file())
        assert du < 16 << 20, du
        assert leftovers(box) == []


def test_bytes_past_the_end_of_the_tar_are_bounded(tmp_path):
    attacker = keypair(tmp_path / "attacker.pem")
    segs = bomb_segments(tmp_path, attacker, listed=1024, actual=1024, trailing=8 << 30)
    path = tmp_path / "bomb.tar.zst"
    path.write_bytes(zstd_frame(segs))
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub"))) as box:
        t0 = time.monotonic()
        r = sbx_import(box, path)
        assert time.monotonic() - t0 < 30
        assert r.returncode != 0 and "refused as a decompression bomb" in r.stderr, r.stderr
        assert leftovers(box) == []


def test_a_manifest_over_the_box_limit_is_refused_before_extraction(tmp_path):
    attacker = keypair(tmp_path / "attacker.pem")
    entries = [("fs", "dir", None), ("fs/f", "file", b"hello")]
    m = manifest_of(entries)
    m["files"]["fs/f"]["size"] = 2 << 30
    path = archive(tmp_path, entries, key=attacker, manifest=m)
    with start(tmp_path, "box", "--trust-key", str(attacker[0].with_suffix(".pub")), "--max-archive-bytes", "1G") as box:
        r = sbx_import(box, path)
        assert r.returncode != 0, r.stdout
        assert "would expand beyond 1073741824 bytes, this box's limit (--max-archive-bytes)" in r.stderr, r.stderr


def _naive_extract_limited(segs, dest, limit):
    """In a child with RLIMIT_FSIZE = limit: tarfile.extractall of the bomb's tar stream, expanded
    lazily. Returns the bytes it wrote."""
    code = f"""
import resource, sys, tarfile, io, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
head = sys.stdin.buffer.read({len(segs[0])})
class Zeros(io.RawIOBase):
    def __init__(self): self.pos = 0; self.head = head
    def readable(self): return True
    def readinto(self, b):
        if self.pos < len(self.head):
            n = min(len(b), len(self.head) - self.pos); b[:n] = self.head[self.pos:self.pos + n]
        else:
            n = min(len(b), {segs[0].__len__() + segs[1]} - self.pos)
            b[:n] = bytes(n)
        self.pos += n
        return n
try:
    with tarfile.open(fileobj=io.BufferedReader(Zeros()), mode="r|") as t:
        t.extractall({str(dest)!r})
except OSError as e:
    print("stopped:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], input=segs[0], capture_output=True, timeout=120)
    return sum(p.stat().st_size for p in pathlib.Path(dest).rglob("*") if p.is_file()), r


def test_control_the_bomb_expands_under_naive_extraction(tmp_path):
    attacker = keypair(tmp_path / "attacker.pem")
    segs = bomb_segments(tmp_path, attacker, listed=1024, actual=16 << 30)
    written, r = _naive_extract_limited(segs, tmp_path / "naive", 64 << 20)
    # The manifest listed 1 KiB; the naive extraction wrote until the rlimit stopped it.
    assert written >= 64 << 20, (written, r.stdout, r.stderr)


# ---- (c) archives no trusted key signed ----

@pytest.fixture(scope="module")
def real_archive(tmp_path_factory):
    """A live checkpoint archive made by a real box with its own (per-test-module) user key."""
    tmp = tmp_path_factory.mktemp("real")
    with start(tmp, "maker", argv=("python3", "-c", COUNTER)) as box:
        time.sleep(1.0)
        out = tmp / "real.tar.zst"
        snap = checkpoint_and_export(box, out)
        created = events(box, "checkpoint.created")[-1]
    return {"path": out, "snap": snap, "mode": created["mode"], "tmp": tmp}


def members_of(path):
    raw = subprocess.run(["zstd", "-q", "-d", "-c", str(path)], check=True, capture_output=True).stdout
    out = []
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        for ti in t.getmembers():
            if ti.isdir():
                out.append((ti.name, "dir", None))
            elif ti.issym():
                out.append((ti.name, "symlink", ti.linkname))
            else:
                out.append((ti.name, "file", t.extractfile(ti).read()))
    return out


def tampered(tmp, real, *, key=None, name="evil.tar.zst"):
    """The real archive with a criu image rewritten by the client, its manifest updated to match,
    and signed by `key` (or not at all)."""
    members = members_of(real["path"])
    m = json.loads(members[0][2])
    payload = [x for x in members if x[0] not in ("manifest.json", "signature.json")]
    images = [i for i, x in enumerate(payload) if x[0].startswith("criu/") and x[1] == "file"]
    if images:
        n, kind, data = payload[images[0]]
        payload[images[0]] = (n, kind, b"\xcc" * len(data))
        m["files"][n] = {"type": "file", "size": len(data), "sha256": sha256(payload[images[0]][2])}
    return archive(tmp, payload, key=key, manifest=m, name=name)


def test_an_unsigned_archive_with_client_written_images_is_refused(tmp_path, real_archive):
    path = tampered(tmp_path, real_archive)
    with start(tmp_path, "box", env=env_with_keys(real_archive["tmp"])) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0, r.stdout
        assert "the archive is refused: it is not signed" in r.stderr, r.stderr
        assert leftovers(box) == [] and list((box.state / "snapshots").iterdir()) == []


def test_an_archive_signed_by_an_unknown_key_is_refused_with_its_fingerprint(tmp_path, real_archive):
    attacker = keypair(tmp_path / "attacker.pem")
    path = tampered(tmp_path, real_archive, key=attacker)
    with start(tmp_path, "box", env=env_with_keys(real_archive["tmp"])) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0, r.stdout
        assert f"it is signed by an unknown key {fingerprint(attacker[1])}" in r.stderr, r.stderr


def test_a_trusted_signature_over_an_altered_manifest_is_refused(tmp_path, real_archive):
    members = members_of(real_archive["path"])
    m = json.loads(members[0][2])
    m["agent"]["argv"] = ["sh", "-c", "echo owned"]
    raw = zstd(tar_bytes([("manifest.json", "file", json.dumps(m).encode() + b"\n")] + members[1:]))
    path = tmp_path / "altered.tar.zst"
    path.write_bytes(raw)
    with start(tmp_path, "box", env=env_with_keys(real_archive["tmp"])) as box:
        r = sbx_import(box, path)
        assert r.returncode != 0 and "does not verify: the manifest was altered" in r.stderr, r.stderr


def test_restore_of_an_archive_signed_by_an_unknown_key_is_refused(tmp_path, real_archive):
    attacker = keypair(tmp_path / "attacker.pem")
    path = tampered(tmp_path, real_archive, key=attacker)
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(tmp_path / "s"),
                        "--events", str(tmp_path / "ev.jsonl"), "--restore", str(path)],
                       capture_output=True, text=True, timeout=120, env=env_with_keys(real_archive["tmp"]))
    assert r.returncode == 125, r.stderr
    failed = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()
              if json.loads(x)["type"] == "restore.failed"]
    assert failed and f"signed by an unknown key {fingerprint(attacker[1])}" in failed[0]["error"], failed


def test_control_allow_unsigned_accepts_it_but_restores_cold_only(tmp_path, real_archive):
    path = tampered(tmp_path, real_archive)
    with start(tmp_path, "box", "--allow-unsigned", env=env_with_keys(real_archive["tmp"])) as box:
        r = sbx_import(box, path)
        assert r.returncode == 0, r.stderr
        reply = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
        assert reply["trusted"] is False and reply["signed_by"] is None, reply
        r = subprocess.run([str(CLI), "restore", box.url, reply["snapshot"], "--token-file", str(box.token_file)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        done = wait_for(lambda: events(box, "restore.done"))
        assert done and done[0]["mode"] == "cold", done
        assert "its criu images unused: the archive is untrusted (it is not signed)" in done[0]["note"]
        # No criu ran: the copy has no restore log, only its command's fresh start.
        assert not list((box.state / "branches").glob("*/.criu/restore.log"))


@pytest.mark.parametrize("agent,reason", [
    ("no box", "its manifest has no box (a string)"),
    (None, "its manifest has no agent (an object: the agent's argv and cwd)"),
    ("x", "its manifest has no agent (an object: the agent's argv and cwd)"),
    ({"argv_b64": 5, "cwd": "/workspace"}, "its manifest's agent.argv_b64: expected an array of strings"),
    ({"argv": ["true"], "cwd_b64": "%%"}, "its manifest's agent.cwd_b64: not valid base64"),
    ({"argv": ["true"]}, "its manifest has no agent.cwd"),
], ids=["no-box", "none", "not-an-object", "argv_b64", "cwd_b64", "no-cwd"])
def test_a_restore_of_an_archive_whose_manifest_lacks_the_agent_is_refused_naming_it(tmp_path, agent, reason):
    # Accepted unsigned (--allow-unsigned: a cold restore runs the manifest's command): before, the
    # restore failed inside with "out of range (internal)" or "not an object (internal)".
    m = manifest_of([("fs", "dir", None)])
    if agent == "no box":
        del m["box"]
    elif agent is None:
        del m["agent"]
    else:
        m["agent"] = agent
    path = archive(tmp_path, [("fs", "dir", None)], manifest=m)
    with start(tmp_path, "box", "--allow-unsigned") as box:
        r = sbx_import(box, path)
        assert r.returncode == 0, r.stderr
        snap = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])["snapshot"]
        r = subprocess.run([str(CLI), "restore", box.url, snap, "--token-file", str(box.token_file)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and f"restore refused: {reason} (bad_snapshot)" in r.stderr, r.stderr
        failed = wait_for(lambda: events(box, "restore.failed"))
        assert failed and failed[0]["error"] == reason, failed
        assert box.alive() and sorted(p.name for p in (box.state / "branches").iterdir()) == ["main"]


# ---- (d) the flows that must keep working ----

def test_an_archive_is_named_by_its_manifests_hash_and_a_format_2_one_by_its_files(tmp_path):
    """Format 3 names a snapshot by the sha256 of manifest.json's bytes, so the same content
    compressed otherwise is the same snapshot; a format-2 archive (made before) is still read,
    named by the sha256 of its file as it was."""
    entries = [("fs", "dir", None), ("fs/workspace", "dir", None), ("fs/workspace/a.txt", "file", b"hello\n")]
    m3 = manifest_of(entries, format_version=3)
    text = json.dumps(m3).encode() + b"\n"
    v3 = archive(tmp_path, entries, manifest=m3, name="v3.tar.zst")
    v3_other = tmp_path / "v3-19.tar.zst"
    v3_other.write_bytes(subprocess.run(["zstd", "-q", "-c", "-19"], input=tar_bytes(
        [("manifest.json", "file", text)] + entries), check=True, capture_output=True).stdout)
    assert v3_other.read_bytes() != v3.read_bytes()
    v2 = archive(tmp_path, entries, name="v2.tar.zst")  # manifest_of's format_version is 2
    with start(tmp_path, "box", "--allow-unsigned") as box:
        got = []
        for path in (v3, v3_other, v2):
            r = sbx_import(box, path)
            assert r.returncode == 0, r.stderr
            got.append(json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1]))
        assert got[0]["snapshot"] == "s-" + sha256(text)[:16], got
        assert got[1]["snapshot"] == got[0]["snapshot"] and got[1]["existing"] is True, got
        assert got[2]["snapshot"] == "s-" + sha256(v2.read_bytes())[:16], got
        assert leftovers(box) == []


def test_control_an_archive_from_a_box_with_the_same_key_is_accepted_and_restored_live(tmp_path, real_archive):
    with start(tmp_path, "box", env=env_with_keys(real_archive["tmp"])) as box:
        r = sbx_import(box, real_archive["path"])
        assert r.returncode == 0, r.stderr
        reply = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
        assert reply["trusted"] is True and reply["signed_by"].startswith("ed25519:"), reply
        r = subprocess.run([str(CLI), "restore", box.url, reply["snapshot"], "--token-file", str(box.token_file)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        done = wait_for(lambda: events(box, "restore.done"))
        assert done and done[0]["mode"] == real_archive["mode"] and "note" not in done[0], done


def test_control_restore_file_from_a_box_with_the_same_key(tmp_path, real_archive):
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(tmp_path / "s"),
                          "--events", str(tmp_path / "ev.jsonl"), "--restore", str(real_archive["path"])],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env_with_keys(real_archive["tmp"]),
                         start_new_session=True)
    try:
        def done():
            f = tmp_path / "ev.jsonl"
            evs = [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
            return [e for e in evs if e["type"] in ("restore.done", "restore.failed")]
        got = wait_for(done, timeout=60)
        assert got and got[0]["type"] == "restore.done" and got[0]["mode"] == real_archive["mode"], got
    finally:
        os.killpg(p.pid, signal.SIGTERM)  # the whole session: unshare forwards nothing
        p.wait(60)


# ---- (e) two imports of one archive at once ----

def test_two_concurrent_imports_of_one_archive_both_end_cleanly(tmp_path, real_archive):
    with start(tmp_path, "box", env=env_with_keys(real_archive["tmp"])) as box:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda _: sbx_import(box, real_archive["path"]), range(2)))
        assert all(r.returncode == 0 for r in rs), [r.stderr for r in rs]
        replies = [json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1]) for r in rs]
        assert {r["snapshot"] for r in replies} == {real_archive["snap"]}
        assert sorted(r["existing"] for r in replies) == [False, True], replies
        assert leftovers(box) == []
        assert [p.name for p in (box.state / "snapshots").glob("*.d")] == [real_archive["snap"] + ".d"]


# ---- the key itself ----

READ_KEY = ("import sys\n"
            "try:\n"
            "    text = open(sys.argv[1]).read()\n"
            "    print('KEY', text.splitlines()[0] if text else '(empty)', flush=True)\n"
            "except OSError as e:\n"
            "    print('REFUSED', e.strerror, flush=True)\n")


def test_the_agent_cannot_read_its_box_signing_key(tmp_path):
    # A key given with --signing-key, in a place the agent otherwise sees (the host's /tmp).
    key, _ = keypair(tmp_path / "box-key.pem")
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(tmp_path / "s"),
                        "--signing-key", str(key), "--events", "-", "--", "python3", "-c", READ_KEY, str(key)],
                       capture_output=True, text=True, timeout=60, env=env_with_keys(tmp_path))
    assert r.returncode == 0, r.stderr
    out = "".join(e.get("data", "") for e in map(json.loads, r.stdout.splitlines()) if e["type"] == "proc.output")
    assert "KEY (empty)" in out and "BEGIN" not in out, out  # masked: an empty file in its view
    # Control: the same program outside the box, on this host as root, reads it.
    outside = subprocess.run(["python3", "-c", READ_KEY, str(key)], capture_output=True, text=True, timeout=30)
    assert "KEY -----BEGIN PRIVATE KEY-----" in outside.stdout
