"""bench/ws: agent stdout to a WebSocket client, sandboxer-init against websocketd on the same
producer and a raw pipe as the limit. Prints one table of numbers and ratios from one run, and
rows for bench/run (bench/_rows.py).

usage: python bench/ws/run.py [--mb 64] [--events 30000]
Not a test: nothing here asserts a time."""
import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import _common  # noqa: E402
import _rows  # noqa: E402
INIT = ROOT / "build" / "bin" / "sandboxer-init"
READER = ROOT / "build" / "bin" / "sbx-ws-reader"
PRODUCER = [sys.executable, str(pathlib.Path(__file__).with_name("producer.py"))]


free_port = _common.free_port


class Gate:
    """The producers' start line (producer.py --gate): every transport's clock starts when its
    producers, already running, are let go, so that none of them counts Python's start-up (~25 ms
    of a 64 MiB run) and the server's time is what is compared."""

    def __init__(self, path, inside=None):
        self.path = pathlib.Path(path)
        self.inside = inside or str(self.path)  # the path as the producer sees it

    def args(self):
        return ["--gate", self.inside]

    def open(self, producers=1, timeout=60):
        """Waits until `producers` producers wait at the gate, lets them go; returns that time."""
        deadline = time.monotonic() + timeout
        while len(list(self.path.parent.glob(self.path.name + ".ready.*"))) < producers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{producers} producer(s) did not reach {self.path} in {timeout} s")
            time.sleep(0.001)
        self.path.touch()
        return time.monotonic()


@contextlib.contextmanager
def gate_dir():
    with tempfile.TemporaryDirectory(prefix="sbx-bench-gate-") as d:
        yield Gate(pathlib.Path(d) / "go")


class Measure:
    def __init__(self):
        self.bytes = 0
        self.lat = []
        self.t0 = time.monotonic()
        self.t1 = None
        self.pending = b""
        self.resumed = 0  # times the client was closed as too slow (4008) and subscribed again

    def feed(self, data: bytes):
        now = time.time_ns()
        self.bytes += len(data)
        buf = self.pending + data
        lines = buf.split(b"\n")
        self.pending = lines.pop()
        done = False
        for l in lines:
            if l.startswith(b"T "):
                self.lat.append((now - int(l[2:])) / 1e6)
            elif l == b"END":
                done = True
        if done:
            self.t1 = time.monotonic()
        return done


def pipe_run(args):
    m = Measure()
    with gate_dir() as gate:
        p = subprocess.Popen(PRODUCER + gate.args() + args, stdout=subprocess.PIPE)
        m.t0 = gate.open()
        fd = p.stdout.fileno()
        while True:
            d = os.read(fd, 1 << 16)
            if not d or m.feed(d):
                break
        p.kill()
        p.wait()
    return m


async def ws_read(url, m, *, subscribe=None, headers=None, decode=None):
    async with connect(url, subprotocols=["sandboxer.v1"] if subscribe is not None else None,
                       additional_headers=headers or {}, max_size=1 << 26, open_timeout=20,
                       ping_interval=None) as ws:
        if subscribe is not None:
            await ws.send(json.dumps({"id": 1, "op": "subscribe", "since": subscribe}))
        async for msg in ws:
            data = decode(msg) if decode else (msg.encode() if isinstance(msg, str) else msg)
            if data is not None and m.feed(data):
                return


@contextlib.contextmanager
def websocketd_server(args, gate):
    """websocketd running the producer (one per connection, each waiting at `gate`), accepting;
    yields its port."""
    port = free_port()
    p = subprocess.Popen(["websocketd", f"--port={port}", "--address=127.0.0.1", "--loglevel=error"] + PRODUCER +
                         gate.args() + args,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        p.kill()
        p.wait()


def websocketd_run(args, clients=1):
    with gate_dir() as gate, websocketd_server(args, gate) as port:
        ms = [Measure() for _ in range(clients)]

        async def start():
            t0 = await asyncio.to_thread(gate.open, clients)
            for m in ms:
                m.t0 = t0

        async def go():
            # websocketd sends one message per line, without its newline (and runs one producer per client).
            await asyncio.gather(start(), *(ws_read(f"ws://127.0.0.1:{port}/", m,
                                                    decode=lambda s: s.encode() + b"\n") for m in ms))
        asyncio.run(go())
        return ms[0] if clients == 1 else ms


def journal_latency(journal_dir):
    """Agent line to journal (ms): the journal's `ts` of each proc.output event against the wall
    clock stamped in the first line it carries (the producer's `rate` mode)."""
    from datetime import datetime
    lat = []
    for f in sorted(pathlib.Path(journal_dir).glob("*.jsonl")):
        # The box still runs: a sealed segment may be compressed (and its plain file removed) once
        # the journal is quiet. A rate run's lines (30,000 of ~200 bytes) stay in the active one.
        try:
            text = f.read_text()
        except FileNotFoundError:
            continue
        for l in text.splitlines():
            e = json.loads(l)
            if e.get("type") != "proc.output" or not e.get("data", "").startswith("T "):
                continue
            ts = datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
            stamp = int(e["data"][2:].split("\n", 1)[0]) / 1e9
            lat.append((ts - stamp) * 1e3)
    return lat


@contextlib.contextmanager
def sandboxer_box(args):
    """A box whose agent is the producer, waiting for its gate; yields (port, token, gate, state)."""
    d = tempfile.mkdtemp(prefix="sbx-bench-")
    token = secrets.token_hex(16)
    tf = pathlib.Path(d) / "token"
    tf.write_text(token)
    # The client connects before the agent starts writing: the producer waits for a file.
    # (/workspace inside the box is state/branches/main/workspace here.)
    gate = Gate(pathlib.Path(d) / "s" / "branches" / "main" / "workspace" / "go", "/workspace/go")
    agent = PRODUCER + gate.args() + args
    # The port comes from the journal's server.listening event (no --events copy to slow it down).
    ev = pathlib.Path(d) / "s" / "journal" / ("%020d.jsonl" % 1)
    p = subprocess.Popen([str(INIT), "--state-dir", f"{d}/s", "--listen", "127.0.0.1:0",
                          "--token-file", str(tf), "--metrics-interval", "0", "--"] + agent,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = None
        for _ in range(200):
            if ev.exists():
                for l in ev.read_text().splitlines():
                    e = json.loads(l)
                    if e["type"] == "server.listening":
                        port = e["port"]
            if port:
                break
            time.sleep(0.02)
        yield port, token, gate, pathlib.Path(d) / "s"
    finally:
        p.terminate()
        p.wait(30)
        # Also the events file carries everything; the disk is not what is measured.
        subprocess.run(["rm", "-rf", d])


def sandboxer_run(args, clients=1):
    with sandboxer_box(args) as (port, token, gate, state):
        ms = [Measure() for _ in range(clients)]

        def decode(msg):
            if '"proc.output"' not in msg[:80] and '"type":"proc.output"' not in msg:
                return None
            e = json.loads(msg)
            if e["type"] != "proc.output" or e.get("proc") != "main":
                return None
            return e["data"].encode() if "data" in e else b""

        async def one(m, first):
            # A client too slow for its queue is closed with 4008 `resume_after=N` and subscribes
            # again after N (tests/protocol/README.md), as the SDKs do; the time that takes is part of the figure.
            since = 0
            while True:
                task = asyncio.create_task(ws_read(f"ws://127.0.0.1:{port}", m, subscribe=since,
                                                   headers={"Authorization": f"Bearer {token}"}, decode=decode))
                if first:
                    await asyncio.sleep(0.3 + 0.01 * clients)
                    t0 = await asyncio.to_thread(gate.open)
                    for x in ms:
                        x.t0 = t0
                    first = False
                try:
                    await task
                    return
                except ConnectionClosedError as e:
                    if not e.rcvd or e.rcvd.code != 4008 or not e.rcvd.reason.startswith("resume_after="):
                        raise
                    since = int(e.rcvd.reason.split("=", 1)[1])
                    m.resumed += 1

        async def go():
            await asyncio.gather(*(one(m, i == 0) for i, m in enumerate(ms)))
        asyncio.run(go())
        if args[0] == "rate":
            ms[0].jlat = journal_latency(state / "journal")
        return ms[0] if clients == 1 else ms


def reader_run(server, args, clients):
    """MiB/s summed over `clients` C++ readers (bench/ws/reader.cpp, one thread each) from the
    moment the producer may start to the last END, and the latencies (ms) of the producer's
    stamped lines where it wrote those: the servers measured, not the client."""
    def read(port, token, go):
        r = subprocess.Popen([str(READER), server, "127.0.0.1", str(port), token, str(clients)],
                             stdout=subprocess.PIPE, text=True)
        t0 = go(r)
        out, _ = r.communicate(timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"sbx-ws-reader against {server} failed")
        lines = [l.split() for l in out.splitlines() if l and l != "ready"]
        rows = [l for l in lines if l[0] != "latency"]
        lat = [float(v) for l in lines if l[0] == "latency" for v in l[1:]]
        return sum(int(b) for b, _ in rows) / (1 << 20) / (max(float(t) for _, t in rows) - t0), lat

    if server == "sandboxer":
        with sandboxer_box(args) as (port, token, gate, _):
            def go(r):
                assert r.stdout.readline().strip() == "ready"
                return gate.open()
            return read(port, token, go)
    with gate_dir() as gate, websocketd_server(args, gate) as port:
        # websocketd starts a producer per connection, once the readers have connected.
        def go(r):
            assert r.stdout.readline().strip() == "ready"
            return gate.open(clients)
        return read(port, "-", go)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=8 if _rows.QUICK else 64)
    ap.add_argument("--events", type=int, default=3000 if _rows.QUICK else 30000)
    ap.add_argument("--lines", type=int, default=20000 if _rows.QUICK else 200000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--clients-mb", type=int, default=1 if _rows.QUICK else 4)
    ap.add_argument("--rounds", type=int, default=1 if _rows.QUICK else 5,
                    help="rounds of the C++ reader's measures, the servers alternating (medians)")
    a = ap.parse_args()
    bulk = ["bulk", str(a.mb << 20), "4096"]
    rate = ["rate", str(a.events), "10000"]
    rows = {}
    for name, fn in [("raw pipe", pipe_run), ("websocketd", websocketd_run), ("sandboxer-init", sandboxer_run)]:
        print(f"... {name}: throughput", file=sys.stderr, flush=True)
        t = fn(bulk)
        print(f"... {name}: latency", file=sys.stderr, flush=True)
        thr = t.bytes / (1 << 20) / (t.t1 - t.t0)
        lat = fn(rate)
        rows[name] = (thr, pct(lat.lat, 0.5), pct(lat.lat, 0.99), len(lat.lat), (t.resumed, lat.resumed),
                      getattr(lat, "jlat", []))
    print(f"bench/ws: {a.mb} MiB of stdout in 4 KiB lines; {a.events} lines at 10k/s (latency)")
    print(f"{'transport':16} {'MiB/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'lines':>7}  resumed after 4008")
    for name, (thr, p50, p99, n, resumed, _jl) in rows.items():
        print(f"{name:16} {thr:9.1f} {p50:9.3f} {p99:9.3f} {n:7d}  {resumed[0]} + {resumed[1]}")
    s, w, r = rows["sandboxer-init"], rows["websocketd"], rows["raw pipe"]
    small = ["bulk", str(a.lines * 100), "100"]
    took = {}
    for name, fn in [("websocketd", websocketd_run), ("sandboxer-init", sandboxer_run)]:
        print(f"... {name}: {a.lines} lines of 100 B", file=sys.stderr, flush=True)
        t = fn(small)
        took[name] = t.t1 - t.t0
    many = ["bulk", str(a.clients_mb << 20), "4096"]
    agg = {}
    for name, fn in [("websocketd", websocketd_run), ("sandboxer-init", sandboxer_run)]:
        print(f"... {name}: {a.clients} clients", file=sys.stderr, flush=True)
        ms = fn(many, clients=a.clients)
        agg[name] = sum(m.bytes for m in ms) / (1 << 20) / (max(m.t1 for m in ms) - min(m.t0 for m in ms))
    # The same measures with the C++ reader for both servers (when it is built), in --rounds
    # rounds that alternate the servers: each figure is the median of the rounds' figures (a
    # percentile of each round's latencies, then their median), so that one slow moment of this
    # noisy machine moves it less. The spread (lowest-highest) is printed beside it.
    cpp, spread = {}, {}
    if READER.exists():
        per = {name: ([], [], [], []) for name in ("websocketd", "sandboxer")}
        for rnd in range(a.rounds):
            for name in per:
                print(f"... {name}: C++ readers, round {rnd + 1} of {a.rounds}", file=sys.stderr, flush=True)
                lat = reader_run(name, rate, 1)[1]
                for into, v in zip(per[name], (reader_run(name, bulk, 1)[0], reader_run(name, many, a.clients)[0],
                                               pct(lat, 0.5), pct(lat, 0.99))):
                    into.append(v)
        for name, figs in per.items():
            cpp[name] = tuple(statistics.median(f) for f in figs)
            spread[name] = tuple((min(f), max(f)) for f in figs)
    jl = s[5]
    print(f"{a.lines} lines of 100 B: sandboxer {took['sandboxer-init']:.3f} s, websocketd {took['websocketd']:.3f} s "
          f"(time ratio {took['sandboxer-init'] / took['websocketd']:.2f})")
    print(f"{a.clients} clients x {a.clients_mb} MiB: aggregate sandboxer {agg['sandboxer-init']:.1f} MiB/s, "
          f"websocketd {agg['websocketd']:.1f} MiB/s (ratio {agg['sandboxer-init'] / agg['websocketd']:.2f})")
    print(f"agent line to journal: p50 {pct(jl, 0.5):.3f} ms, p99 {pct(jl, 0.99):.3f} ms ({len(jl)} events)")
    print(f"ratios: throughput sandboxer/websocketd {s[0] / w[0]:.2f}, sandboxer/pipe {s[0] / r[0]:.2f}; "
          f"p50 latency sandboxer/websocketd {s[1] / w[1]:.2f}, p99 {s[2] / w[2]:.2f}")
    thr = f"agent stdout to one WebSocket client, {a.mb} MiB in 4 KiB lines"
    lat = f"event latency at 10k lines/s, {a.events} lines"
    slow = lambda k: (f"our client was closed as too slow (4008) {k} time(s) and subscribed again"
                      if k else None)
    for peer, theirs in (("websocketd", w), ("a raw pipe (the limit)", r)):
        _rows.emit("ws", thr, "MiB/s", s[0], peer, theirs[0], better="higher", note=slow(s[4][0]))
    _rows.emit("ws", lat + ", p50", "ms", s[1], "websocketd", w[1], note=slow(s[4][1]))
    _rows.emit("ws", lat + ", p99", "ms", s[2], "websocketd", w[2], note=slow(s[4][1]))
    _rows.emit("ws", f"{a.lines} lines of 100 B to one client, time", "s", took["sandboxer-init"], "websocketd",
               took["websocketd"])
    _rows.emit("ws", f"{a.clients} clients each reading {a.clients_mb} MiB in 4 KiB lines, aggregate", "MiB/s",
               agg["sandboxer-init"], "websocketd (one producer per client)", agg["websocketd"], better="higher")
    _rows.emit("ws", lat + ", agent line to journal p50", "ms", pct(jl, 0.5))
    if cpp:
        lo_hi = lambda name, i, f="{:.0f}": "-".join(f.format(v) for v in spread[name][i])
        print(f"C++ readers, medians of {a.rounds} rounds (lowest-highest): one client {cpp['sandboxer'][0]:.1f} MiB/s "
              f"({lo_hi('sandboxer', 0)}) against websocketd's {cpp['websocketd'][0]:.1f} ({lo_hi('websocketd', 0)}); "
              f"{a.clients} clients {cpp['sandboxer'][1]:.1f} MiB/s ({lo_hi('sandboxer', 1)}) against "
              f"{cpp['websocketd'][1]:.1f} ({lo_hi('websocketd', 1)})")
        _rows.emit("ws", thr + f", C++ reader, median of {a.rounds} rounds", "MiB/s", cpp["sandboxer"][0],
                   "websocketd", cpp["websocketd"][0], better="higher")
        _rows.emit("ws", f"{a.clients} clients each reading {a.clients_mb} MiB in 4 KiB lines, aggregate, C++ readers, "
                   f"median of {a.rounds} rounds",
                   "MiB/s", cpp["sandboxer"][1], "websocketd (one producer per client)", cpp["websocketd"][1],
                   better="higher")
        ours, theirs = cpp["sandboxer"], cpp["websocketd"]
        f3 = "{:.3f}"
        print(f"C++ reader latency, medians of {a.rounds} rounds: p50 {ours[2]:.3f} ms, p99 {ours[3]:.3f} ms "
              f"({lo_hi('sandboxer', 3, f3)}) against websocketd's {theirs[2]:.3f} and {theirs[3]:.3f} "
              f"({lo_hi('websocketd', 3, f3)})")
        for q, i in ((50, 2), (99, 3)):
            _rows.emit("ws", f"{lat}, p{q}, C++ reader, median of {a.rounds} rounds", "ms", ours[i], "websocketd",
                       theirs[i])


if __name__ == "__main__":
    main()
