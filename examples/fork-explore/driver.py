"""The fork-explore driver (started by `run`): one box, N copies of one agent, the best result kept.

It starts a box (here, `sandboxer run --listen`; or in Docker, `sandboxer up --host docker`),
uploads the agent over the box's API (sdk/python's `Box.fs`: the same on every host, and no bind
mount for criu to treat as external), follows the box's event stream from seq 0, gathers each
copy's result line (a `proc.message` whose `branch` names the copy), keeps the shortest tour,
prints a summary and shuts the box down.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "sdk" / "python"))
from sandboxer import Box, SandboxerError  # noqa: E402

DIR = "/workspace/fork-explore"
# The box's command waits for the upload, then becomes the agent (exec: nothing of the shell is
# left in the tree the supervisor checkpoints). Relative paths: the agent's working directory is
# its workspace whether or not it runs in a mount namespace of its own. A cold restart runs this
# same command again and finds the files already there.
LAUNCH = "until [ -e fork-explore/go ]; do sleep 0.05; done; exec python3 fork-explore/agent.py {args}"


def cli_path() -> str:
    for cand in (os.environ.get("SANDBOXER_CLI"), str(ROOT / "build" / "bin" / "sandboxer"), shutil.which("sandboxer")):
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("run: no sandboxer CLI (build it with scripts/build, or set SANDBOXER_CLI)")


class LocalBox:
    """`sandboxer run --listen 127.0.0.1:0` on this machine; the URL comes from its events."""

    def __init__(self, cli: str, profile: str, state_dir: str, argv: list[str], sets: list[str]) -> None:
        self.state_dir = state_dir
        cmd = [cli, "run", "--json", "--listen", "127.0.0.1:0", "--profile", profile, "--state-dir", state_dir]
        for s in sets:
            cmd += ["--set", s]
        self.proc = subprocess.Popen([*cmd, "--", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.url: str | None = None
        self.stderr: list[str] = []
        got = threading.Event()

        def read_events() -> None:
            for line in self.proc.stdout:  # drained to the end, so the box never blocks on us
                if self.url is None and '"server.listening"' in line:
                    ev = json.loads(line)
                    self.url = f"ws://127.0.0.1:{ev['port']}"
                    got.set()
            got.set()

        threading.Thread(target=read_events, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        got.wait(60)
        if self.url is None:
            self.proc.kill()
            sys.exit("run: the box did not start serving: " + "".join(self.stderr)[-2000:])

    def close(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class DockerBox:
    """`sandboxer up --host docker`: one container of the runtime image; `down` removes it."""

    def __init__(self, cli: str, profile: str, image: str | None, argv: list[str], sets: list[str]) -> None:
        self.cli = cli
        cmd = [cli, "up", "--host", "docker", "--profile", profile]
        if image:
            cmd += ["--image", image]
        for s in sets:
            cmd += ["--set", s]
        r = subprocess.run([*cmd, "--", *argv], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            sys.exit("run: sandboxer up failed: " + r.stderr.strip())
        self.url = r.stdout.strip().splitlines()[-1]
        ps = subprocess.run([cli, "ps", "--json"], capture_output=True, text=True, timeout=60).stdout
        boxes = [json.loads(line) for line in ps.splitlines() if line.strip()]
        self.state_dir = next((b["state_dir"] for b in boxes if b.get("url") == self.url), None)

    def close(self) -> None:
        subprocess.run([self.cli, "down", self.url], capture_output=True, text=True, timeout=120)


async def upload(box: Box) -> None:
    await box.fs.mkdir(DIR)
    await box.fs.write(f"{DIR}/agent.py", (HERE / "agent.py").read_bytes())
    await box.fs.write(f"{DIR}/sandboxer_agent.py", (ROOT / "sdk/python/sandboxer/agent.py").read_bytes())
    await box.fs.write(f"{DIR}/go", b"")


async def gather(box: Box, deadline: float) -> dict:
    """Follows the box's events until every copy has reported (or ended without a result)."""
    g: dict = {"copies": {}, "restores": {}, "results": {}, "ended": {}, "prefix": None, "forked": None,
               "fork_failed": None, "cold": {}, "checkpoint": None, "capabilities": None, "timed_out": False,
               "fork_ms": None}
    stream = box.events(since=0)
    try:
        while True:
            try:
                ev = await asyncio.wait_for(stream.__anext__(), max(0.1, deadline - time.monotonic()))
            except (asyncio.TimeoutError, TimeoutError):
                g["timed_out"] = True
                return g
            except StopAsyncIteration:
                return g  # the box ended
            t, branch = ev["type"], ev.get("branch")
            if t == "box.started":
                g["capabilities"] = ev.get("capabilities")
            elif t == "checkpoint.created":
                g["checkpoint"] = {k: ev.get(k) for k in ("snapshot", "mode", "note", "timings_ms")}
            elif t == "fork.created":
                g["fork_ms"] = (ev.get("timings_ms") or {}).get("total")
            elif t == "restore.done":
                g["restores"][branch] = ev
            elif t == "restore.failed":
                g["ended"][branch] = "restore failed: " + str(ev.get("error"))
            elif t == "proc.message":
                m = ev["message"]
                step = m.get("step")
                if branch == "main" and step == "prefix":
                    g["prefix"] = m
                elif branch == "main" and step == "forked":
                    g["forked"] = m
                    g["copies"] = {c["branch"]: c for c in m.get("copies") or []}
                elif branch == "main" and step == "fork_failed":
                    g["fork_failed"] = m
                elif step == "cold_restart":
                    g["cold"][branch] = m
                elif step == "result":
                    g["results"][branch] = m
            elif t == "proc.exited" and branch != "main":
                g["ended"][branch] = f"ended ({ev.get('reason')}, {ev.get('code', ev.get('signal'))})"
            elif t == "proc.exited" and branch == "main" and not g["forked"]:
                g["fork_failed"] = g["fork_failed"] or {"message": f"the agent ended before its fork ({ev.get('reason')})"}
            if g["fork_failed"] and not g["copies"]:
                # Some copies may have started before the fork failed (every restore event comes
                # before the agent's reply): follow those.
                g["copies"] = {b: {"branch": b} for b in [*g["restores"], *g["ended"]]}
            # Done when every copy has ended (with its result line, or without one).
            if (g["forked"] or g["fork_failed"]) and all(b in g["ended"] for b in g["copies"]):
                return g
    finally:
        await stream.close()


def summarize(g: dict, host: str) -> dict:
    prefix = g["prefix"] or {}
    rows = []
    for b in sorted(g["copies"], key=lambda b: (g["copies"][b].get("index", 0), b)):
        r = g["results"].get(b)
        mode = (g["restores"].get(b) or {}).get("mode")
        row = {"branch": b, "mode": mode}
        if r is None:
            row["error"] = "no result: " + g["ended"].get(b, "still running")
        else:
            row.update(index=r["index"], strategy=r["strategy"], length=r["length"], search_s=r["search_s"],
                       prefix_s=r["prefix_s"], continued=r["continued"],
                       same_state=r["state"] == prefix.get("state"), same_nonce=r["nonce"] == prefix.get("nonce"))
        rows.append(row)
    ok = [r for r in rows if "length" in r]
    best = min(ok, key=lambda r: r["length"]) if ok else None
    caps = g["capabilities"] or {}
    return {"host": host, "live_checkpoint": caps.get("live_checkpoint"), "why_not": caps.get("why_not"),
            "checkpoint": g["checkpoint"], "fork_ms": g["fork_ms"], "prefix": prefix, "fork_failed": g["fork_failed"],
            "copies": rows, "best": best, "timed_out": g["timed_out"]}


def print_summary(s: dict) -> None:
    p = s["prefix"]
    if p:
        print(f"prefix: {p['cities']} cities, start tour {p['start']:.1f} after {p['prefix_s']:.2f} s "
              f"(state {p['state'][:12]}, in-memory nonce {p['nonce'][:12]})")
    if s["fork_failed"]:
        print(f"fork failed: {s['fork_failed'].get('code', '')} {s['fork_failed'].get('message', '')}")
    cp = s["checkpoint"] or {}
    if cp:
        dump = (cp.get("timings_ms") or {}).get("total")
        line = f"checkpoint {cp.get('snapshot')}: {cp.get('mode')}" + (f" ({cp['note']})" if cp.get("note") else "")
        if dump is not None:
            line += f", taken in {dump:.0f} ms"
        if s["fork_ms"] is not None:
            line += f"; {len(s['copies'])} copies started in {s['fork_ms']:.0f} ms"
        print(line)
    for r in s["copies"]:
        if "error" in r:
            print(f"  {r['branch']:>4}  {r['mode'] or '-':>4}  {r['error']}")
            continue
        if r["continued"] and r["same_state"] and r["same_nonce"]:
            how = "continued from the prefix in memory (same state, same nonce)"
        elif not r["continued"]:
            how = f"cold restart: redid the prefix in {r['prefix_s']:.2f} s" + (" (same state)" if r["same_state"] else "")
        else:
            how = "DIFFERENT state from the prefix"
        st = r["strategy"]
        print(f"  {r['branch']:>4}  {r['mode']:>4}  seed {st['seed']} heat {st['heat']:<4}  "
              f"tour {r['length']:.1f} in {r['search_s']:.2f} s  {how}")
    if s["timed_out"]:
        print("timed out: not every copy reported")
    b = s["best"]
    if b and p:
        gain = 100.0 * (p["start"] - b["length"]) / p["start"]
        print(f"best: {b['branch']} (seed {b['strategy']['seed']}, heat {b['strategy']['heat']}): "
              f"tour {b['length']:.1f}, {gain:.1f} % shorter than the start")


async def drive(args: argparse.Namespace) -> int:
    cli = cli_path()
    agent_args = f"--copies {args.copies} --cities {args.cities} --moves {args.moves} --wait {args.timeout}"
    argv = ["sh", "-c", LAUNCH.format(args=agent_args)]
    if args.host == "local":
        state = args.state_dir or tempfile.mkdtemp(prefix="fork-explore-")
        host = LocalBox(cli, args.profile, state, argv, args.set)
    else:
        host = DockerBox(cli, args.profile, args.image, argv, args.set)
    print(f"box: {host.url} (journal: {host.state_dir})", file=sys.stderr)
    try:
        async with await Box.connect(host.url) as box:
            await upload(box)
            g = await gather(box, time.monotonic() + args.timeout)
            summary = summarize(g, args.host)
            summary["url"], summary["state_dir"] = host.url, host.state_dir
            try:
                await box.shutdown(grace="2s")
            except SandboxerError:
                pass  # already stopping
    finally:
        host.close()
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
        print(f"box shut down; its journal: sandboxer log {host.state_dir}")
    return 0 if summary["best"] and all("length" in r for r in summary["copies"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(prog="examples/fork-explore/run", description=__doc__.splitlines()[0])
    ap.add_argument("--host", choices=("local", "docker"), default="local")
    ap.add_argument("--profile", default="explorer", help="a checkpoint-capable profile (default: explorer)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="profile override")
    ap.add_argument("--image", help="the runtime image (docker)")
    ap.add_argument("--state-dir", help="the box's state dir (local; default: a new temp dir)")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--cities", type=int, default=800)
    ap.add_argument("--moves", type=int, default=300000)
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for every copy")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = ap.parse_args()
    return asyncio.run(drive(args))


if __name__ == "__main__":
    sys.exit(main())
