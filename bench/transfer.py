#!/usr/bin/env python3
"""A file into and out of a box: `sandboxer cp` as a whole command (sdk/cpp's transfer_file, over
Boost.Beast) against sdk/python's `box.fs.read`/`box.fs.write` (the websockets package, another
client of the same server) and, as the floor no transfer can beat, `cp` on the host of the same
file between the same directories. Medians of interleaved runs, in one run.

Prints one table: what, our figure, each peer's figure, ratio; and rows for bench/run
(bench/_rows.py). Not a test: nothing asserts."""
import asyncio
import json
import os
import pathlib
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(os.environ.get("SANDBOXER_BIN", ROOT / "build" / "bin"))
sys.path.insert(0, str(ROOT / "sdk" / "python"))
MIB = 64 if _rows.QUICK else 256
RUNS = 3 if _rows.QUICK else 7


def start_box(d, agent=("sleep", "3600")):
    """sandboxer-init on a loopback port with a token, running `agent` (idle without one): (process,
    URL, token file, workspace)."""
    d.mkdir(exist_ok=True)
    tf = d / "token"
    tf.write_text(secrets.token_hex(16))
    tf.chmod(0o600)
    tail = ["--", *agent] if agent else ["--idle"]
    p = subprocess.Popen([str(BIN / "sandboxer-init"), "--state-dir", str(d / "s"), "--listen", "127.0.0.1:0",
                          "--token-file", str(tf), "--metrics-interval", "0", "--set", "resources.grace=1s", *tail],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for seg in sorted((d / "s" / "journal").glob("*.jsonl")) if (d / "s" / "journal").exists() else []:
            for line in seg.read_text().splitlines():
                e = json.loads(line)
                if e["type"] == "server.listening":
                    return p, f"ws://127.0.0.1:{e['port']}", tf, d / "s" / "branches" / "main" / "workspace"
        time.sleep(0.02)
    p.kill()
    raise RuntimeError("the box did not listen within 20 s")


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sdk_python(url, tf, op, path, data=None):
    from sandboxer import Box

    async def go():
        async with await Box.connect(url, token_file=str(tf)) as box:
            if op == "read":
                got = await box.fs.read(path)
                assert len(got) == MIB << 20
            else:
                await box.fs.write(path, data)
    asyncio.run(go())


def main():
    d = pathlib.Path(tempfile.mkdtemp(prefix="sbx-bench-transfer-"))
    p, url, tf, ws = start_box(d)
    try:
        src = d / "src.bin"
        with open(src, "wb") as f:
            for _ in range(MIB):
                f.write(os.urandom(1 << 20))
        shutil.copyfile(src, ws / "f.bin")
        data = src.read_bytes()
        cli = [str(BIN / "sandboxer"), "cp", "--token-file", str(tf)]
        run = lambda *a: subprocess.run(cli + list(a), check=True, capture_output=True)  # noqa: E731
        times = {k: [] for k in ("out cp", "out py", "out host", "in cp", "in py", "in host")}
        for _ in range(RUNS):
            times["out cp"].append(timed(lambda: run(f"{url}:/workspace/f.bin", str(d / "out.bin"))))
            times["out py"].append(timed(lambda: sdk_python(url, tf, "read", "/workspace/f.bin")))
            times["out host"].append(timed(lambda: subprocess.run(["cp", str(ws / "f.bin"), str(d / "out.bin")],
                                                                  check=True)))
            times["in cp"].append(timed(lambda: run(str(src), f"{url}:/workspace/in.bin")))
            times["in py"].append(timed(lambda: sdk_python(url, tf, "write", "/workspace/in.bin", data)))
            times["in host"].append(timed(lambda: subprocess.run(["cp", str(src), str(ws / "in.bin")], check=True)))
        med = {k: statistics.median(v) for k, v in times.items()}
    finally:
        p.terminate()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)
    print(f"# transfer: a {MIB} MiB file, median of {RUNS} interleaved runs each; {os.uname().nodename}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print_ways(med, {"cp": "sandboxer cp", "py": "sdk/python box.fs", "host": "cp on the host (the floor)"},
               "MiB/s", MIB, lambda label: f"a {MIB} MiB file {label}, `sandboxer cp` whole command, median of {RUNS}")
    d = pathlib.Path(tempfile.mkdtemp(prefix="sbx-bench-tree-"))
    try:
        tree_rows(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    d = pathlib.Path(tempfile.mkdtemp(prefix="sbx-bench-send-"))
    try:
        send_rows(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


TREE_DIRS, TREE_FILES = 10, 50  # 500 files of 1 KiB


def sdk_python_tree(url, tf, way, box_dir, local_dir):
    """The peer of `cp -r`: one connection of sdk/python, the tree walked with fs.list and each
    file read or written with fs.read or fs.write in turn."""
    from sandboxer import Box

    async def out(box, remote, local):
        local.mkdir()
        for e in await box.fs.list(remote):
            if e["type"] == "dir":
                await out(box, f"{remote}/{e['name']}", local / e["name"])
            else:
                (local / e["name"]).write_bytes(await box.fs.read(f"{remote}/{e['name']}"))

    async def into(box, local, remote):
        await box.fs.mkdir(remote)
        for p in sorted(local.iterdir()):
            if p.is_dir():
                await into(box, p, f"{remote}/{p.name}")
            else:
                await box.fs.write(f"{remote}/{p.name}", p.read_bytes())

    async def go():
        async with await Box.connect(url, token_file=str(tf)) as box:
            await (out(box, box_dir, local_dir) if way == "out" else into(box, local_dir, box_dir))
    asyncio.run(go())


def tree_rows(d):
    """A tree of many small files into and out of a box: `sandboxer cp -r` (one connection per
    file) against sdk/python on one connection and the host's `cp -r` of the same tree."""
    p, url, tf, ws = start_box(d)
    try:
        src = d / "tree"
        for i in range(TREE_DIRS):
            (src / f"d{i}").mkdir(parents=True)
            for j in range(TREE_FILES):
                (src / f"d{i}" / f"f{j}").write_bytes(os.urandom(1024))
        shutil.copytree(src, ws / "tree")
        cli = [str(BIN / "sandboxer"), "cp", "-r", "--token-file", str(tf)]
        run = lambda *a: subprocess.run(cli + list(a), check=True, capture_output=True)  # noqa: E731
        host = lambda a, b: subprocess.run(["cp", "-r", str(a), str(b)], check=True)  # noqa: E731
        times = {k: [] for k in ("out cp", "out py", "out host", "in cp", "in py", "in host")}
        for i in range(RUNS):
            times["out cp"].append(timed(lambda: run(f"{url}:/workspace/tree", str(d / f"o-cp{i}"))))
            times["out py"].append(timed(lambda: sdk_python_tree(url, tf, "out", "/workspace/tree", d / f"o-py{i}")))
            times["out host"].append(timed(lambda: host(ws / "tree", d / f"o-host{i}")))
            times["in cp"].append(timed(lambda: run(str(src), f"{url}:/workspace/i-cp{i}")))
            times["in py"].append(timed(lambda: sdk_python_tree(url, tf, "in", f"/workspace/i-py{i}", src)))
            times["in host"].append(timed(lambda: host(src, ws / f"i-host{i}")))
        med = {k: statistics.median(v) for k, v in times.items()}
    finally:
        stop(p)
    n = TREE_DIRS * TREE_FILES
    print(f"# transfer: a tree of {n} files of 1 KiB in {TREE_DIRS} directories, median of {RUNS} interleaved runs")
    print_ways(med, {"cp": "sandboxer cp -r", "py": "sdk/python box.fs, one connection", "host": "cp -r on the host"},
               "files/s", n,
               lambda label: f"a tree of {n} files of 1 KiB {label}, `sandboxer cp -r` whole command, median of {RUNS}")


def print_ways(med, names, rate, amount, what_of):
    """The table of both ways (med: "out cp", "in py", ... -> seconds): each client's time, `amount`
    per second, and the ratio of ours ("cp") to each peer; the rows for bench/run."""
    print(f"{'what':52} {'time':>9} {rate:>8} {'ratio (ours / peer)':>20}")
    for way, label in (("out", "out of a box"), ("in", "into a box")):
        ours = med[f"{way} cp"]
        for who in ("cp", "py", "host"):
            v = med[f"{way} {who}"]
            ratio = "" if who == "cp" else f"{ours / v:.2f}"
            print(f"{label + ', ' + names[who]:52} {v * 1000:7.0f}ms {amount / v:8.0f} {ratio:>20}")
        for who in ("py", "host"):
            _rows.emit("transfer", what_of(label), "ms", ours * 1000, names[who], med[f"{way} {who}"] * 1000)


def stop(p):
    p.terminate()
    p.wait()


def send_rows(d):
    """A live agent's snapshot (MIB MiB of random bytes in its memory) from one box into a new idle
    one: `sandboxer send --whole` (the relay: read from the source once, fed to the target as it
    comes) against `sandboxer export` to a host file then `sandboxer import` of it, each into a
    box of its own. Medians of interleaved runs."""
    agent = (sys.executable, "-c", f"import os, time\nb = os.urandom({MIB} << 20)\nprint('ready', flush=True)\n"
             "time.sleep(3600)")
    p, url, tf, _ = start_box(d / "src", agent)
    procs = [p]
    try:
        time.sleep(3 if _rows.QUICK else 6)  # the agent's bytes are in memory
        cli = str(BIN / "sandboxer")
        r = subprocess.run([cli, "checkpoint", url, "--token-file", str(tf)], check=True, capture_output=True,
                           text=True)
        snap = r.stdout.strip().splitlines()[-1]
        times = {"send": [], "export+import": []}
        size = 0
        for i in range(RUNS):
            for way in times:
                tp, turl, ttf, _ = start_box(d / f"t-{way[0]}{i}", None)
                procs.append(tp)
                if way == "send":
                    cmd = [cli, "send", url, snap, "--token-file", str(tf), "--to", turl, "--to-token-file", str(ttf),
                           "--whole"]
                    times[way].append(timed(lambda: subprocess.run(cmd, check=True, capture_output=True)))
                else:
                    f = d / "snap.tar.zst"
                    ex = [cli, "export", url, snap, str(f), "--token-file", str(tf)]
                    im = [cli, "import", turl, str(f), "--token-file", str(ttf)]
                    times[way].append(timed(lambda: (subprocess.run(ex, check=True, capture_output=True),
                                                     subprocess.run(im, check=True, capture_output=True))))
                    size = f.stat().st_size
                    f.unlink()
                stop(procs.pop())
                shutil.rmtree(d / f"t-{way[0]}{i}", ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
    finally:
        for q in procs:
            stop(q)
    mb = size / (1 << 20)
    print(f"# send: a snapshot of {mb:.0f} MiB (an agent holding {MIB} MiB of random bytes) into a new idle box, "
          f"median of {RUNS} interleaved runs each")
    print(f"{'what':52} {'time':>9} {'MiB/s':>8} {'ratio (ours / peer)':>20}")
    for who, label in (("send", "sandboxer send --whole"), ("export+import", "export to a host file, then import")):
        ratio = "" if who == "send" else f"{med['send'] / med[who]:.2f}"
        print(f"{label:52} {med[who] * 1000:7.0f}ms {mb / med[who]:8.0f} {ratio:>20}")
    _rows.emit("transfer", f"a {mb:.0f} MiB snapshot from a box into another, `sandboxer send --whole`, median of {RUNS}",
               "ms", med["send"] * 1000, "export to a host file, then import", med["export+import"] * 1000)


if __name__ == "__main__":
    sys.exit(main())
