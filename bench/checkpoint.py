#!/usr/bin/env python3
"""Checkpoint benchmark: dump, restore and fork-of-8 through sandboxer against the raw criu CLI
on the same tree, for agents of ~50 MB and (with --big) ~1 GB of heap. Prints ratios.

    sudo python3 bench/checkpoint.py [--big] [--build build]

Ours: the agent checkpoints itself (leave_running) and forks 8 copies through the agent channel;
the numbers are the supervisor's own (checkpoint.created, restore.done, fork.created), so they
include the filesystem snapshot, the archive (zstd + sha256) and the pipe plumbing.
Raw: `criu dump --leave-running` of a holding agent's tree with the same flags, then `criu
restore` of those images (one, then 8 at once), each in a fresh network namespace.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SDK = ROOT / "sdk" / "python" / "sandboxer"

AGENT = r'''
import os, sys, time
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
heap = bytearray(os.urandom(int(sys.argv[2]) << 20))
if sys.argv[1] == "hold":
    print("ready", flush=True)
    time.sleep(600)
ch = agent.Channel()
if ch.checkpoint("bench", leave_running=True).get("copy"):
    sys.exit(0)  # restored from the archive into a new box: that was the measurement
ch.fork(8)
'''


def journal(init_dir, state):
    out = subprocess.run([str(init_dir / "sandboxer"), "log", str(state), "--json"], capture_output=True,
                         check=True, timeout=120).stdout
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def ours(bindir, tmp, mb):
    state = tmp / f"ours-{mb}"
    env = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    subprocess.run([str(bindir / "sandboxer-init"), "--state-dir", str(state), "--", sys.executable, "-c", AGENT,
                    "run", str(mb)], check=True, timeout=900, env=env, capture_output=True)
    ev = journal(bindir, state)
    created = [e for e in ev if e["type"] == "checkpoint.created"]
    fork = next(e for e in ev if e["type"] == "fork.created")
    first = created[0]
    restores = [c["timings_ms"]["restore"] for c in fork["copies"]]
    # One restore into a new box from the archive (import, verify, extract, restore).
    t0 = time.monotonic()
    p = subprocess.Popen([str(bindir / "sandboxer-init"), "--state-dir", str(tmp / f"ours-r-{mb}"), "--restore",
                          first["archive"]], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p.wait(timeout=900)
    rev = journal(bindir, tmp / f"ours-r-{mb}")
    done = next(e for e in rev if e["type"] == "restore.done")
    started = next(e for e in rev if e["type"] == "box.started")

    def ts(e):
        from datetime import datetime
        return datetime.strptime(e["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()
    return {
        "dump_s": first["timings_ms"]["dump"] / 1e3,
        "checkpoint_total_s": first["timings_ms"]["total"] / 1e3,
        "freeze_s": first["timings_ms"]["freeze"] / 1e3,
        "archive_mb": first["sizes"]["compressed"] / 1e6,
        "images_mb": first["sizes"]["images"] / 1e6,
        "restore_s": done["timings_ms"]["restore"] / 1e3,
        "restore_from_archive_s": ts(done) - ts(started),
        "fork8_s": fork["timings_ms"]["total"] / 1e3,
        "fork_copy_restore_mean_s": sum(restores) / len(restores) / 1e3,
    }


def raw(bindir, tmp, mb):
    state = tmp / f"raw-{mb}"
    env = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    box = subprocess.Popen([str(bindir / "sandboxer-init"), "--state-dir", str(state), "--events", "-", "--",
                            sys.executable, "-c", AGENT, "hold", str(mb)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        for line in box.stdout:
            e = json.loads(line)
            # The agent's own line (its program text is in proc.started's argv too).
            if e["type"] == "proc.output" and e.get("data", "").startswith("ready"):
                break
        ns_init = int(open(f"/proc/{box.pid}/task/{box.pid}/children").read().split()[0])
        agent_pid = int(open(f"/proc/{ns_init}/task/{ns_init}/children").read().split()[0])
        # The pipes crossing the tree's boundary, with the end the tree holds (launcher.hpp).
        pipes = {}
        for pid, fd, end in ((ns_init, 3, "r"), (ns_init, 4, "w"), (agent_pid, 0, "r"), (agent_pid, 1, "w"),
                             (agent_pid, 2, "w"), (agent_pid, 3, "w"), (agent_pid, 4, "r")):
            pipes[os.readlink(f"/proc/{pid}/fd/{fd}")] = end
        img = tmp / f"raw-img-{mb}"
        img.mkdir()
        t0 = time.monotonic()
        subprocess.run(["criu", "dump", "-t", str(ns_init), "-D", str(img), "-o", "dump.log", "--external", "mnt[]",
                        "--external", "mnt[/workspace]:workspace", "--external", "mnt[/tmp]:tmp", "--external",
                        "mnt[/run]:run", "--manage-cgroups=ignore", "--tcp-established", "--network-lock", "skip",
                        "--file-locks", "--leave-running"], check=True, timeout=900)
        dump_s = time.monotonic() - t0

        def restore_many(n):
            procs, keep = [], []
            t = time.monotonic()
            for i in range(n):
                d = tmp / f"raw-copy-{mb}-{n}-{i}"
                for sub in ("root", "workspace", "tmp", "run"):
                    shutil.copytree(state / "branches" / "main" / sub, d / sub, symlinks=True)
                # The state dir is masked in the branch's view: under /tmp, its mount point must
                # exist in the copy's own /tmp (as the supervisor does it).
                if str(state).startswith("/tmp/"):
                    (d / "tmp" / str(state)[5:]).mkdir(parents=True, exist_ok=True)
                args, fds = [], []
                for k, (link, _) in enumerate(pipes.items()):
                    r, w = os.pipe()
                    keep += [r, w]
                    # The tree's end: read ends of requests/stdin, write ends of the rest.
                    mine = r if _ == "r" else w
                    fds.append(mine)
                    args += ["--inherit-fd", f"fd[{mine}]:{link}"]
                procs.append(subprocess.Popen(
                    ["unshare", "-n", "sh", "-c", 'ip link set lo up; exec "$@"', "x", "criu", "restore", "-D",
                     str(img), "-o", f"restore-{n}-{i}.log", "--root", str(d / "root"), "--restore-sibling",
                     "--restore-detached", "--manage-cgroups=ignore", "--tcp-close", "--file-locks",
                     "--ext-mount-map", "auto", "--external", f"mnt[workspace]:{d}/workspace",
                     "--external", f"mnt[tmp]:{d}/tmp", "--external", f"mnt[run]:{d}/run",
                     "--pidfile", str(d / "pid"), *args], pass_fds=fds))
            for p in procs:
                p.wait(timeout=900)
            elapsed = time.monotonic() - t
            for i in range(n):
                pidf = tmp / f"raw-copy-{mb}-{n}-{i}" / "pid"
                if pidf.exists():
                    try:
                        os.kill(int(pidf.read_text()), 9)
                    except ProcessLookupError:
                        pass
            for fd in keep:
                os.close(fd)
            return elapsed, all(p.returncode == 0 for p in procs)

        restore_s, ok1 = restore_many(1)
        fork8_s, ok8 = restore_many(8)
        return {"dump_s": dump_s, "restore_s": restore_s, "fork8_s": fork8_s, "ok": ok1 and ok8}
    finally:
        box.terminate()
        box.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also the ~1 GB agent")
    ap.add_argument("--build", default=str(ROOT / "build"))
    a = ap.parse_args()
    bindir = pathlib.Path(a.build) / "bin"
    sizes = [50] + ([1024] if a.big else [])
    with tempfile.TemporaryDirectory(prefix="sbx-bench-") as t:
        tmp = pathlib.Path(t)
        for mb in sizes:
            o = ours(bindir, tmp, mb)
            r = raw(bindir, tmp, mb)
            print(f"== agent with {mb} MB of heap")
            print(f"   ours: dump {o['dump_s']:.3f}s (freeze {o['freeze_s']:.3f}s, checkpoint with archive "
                  f"{o['checkpoint_total_s']:.3f}s, images {o['images_mb']:.0f} MB, archive {o['archive_mb']:.0f} MB)")
            print(f"         restore {o['restore_s']:.3f}s (a new box from the archive, verify and extract "
                  f"included: "
                  f"{o['restore_from_archive_s']:.3f}s), fork of 8 {o['fork8_s']:.3f}s")
            print(f"   raw criu: dump {r['dump_s']:.3f}s, restore {r['restore_s']:.3f}s, fork of 8 {r['fork8_s']:.3f}s"
                  f"{'' if r['ok'] else ' (some raw restores FAILED)'}")
            print(f"   ratio ours/raw: dump {o['dump_s'] / r['dump_s']:.2f}, restore {o['restore_s'] / r['restore_s']:.2f}, "
                  f"fork of 8 {o['fork8_s'] / r['fork8_s']:.2f}")


if __name__ == "__main__":
    main()
