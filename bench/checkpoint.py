#!/usr/bin/env python3
"""Checkpoint benchmark: dump, restore and fork-of-8 through sandboxer against the raw criu CLI
on the same tree and against podman checkpoint/restore --export/--import of the same agent, for
agents of ~50 MB and (with --big) ~1 GB of heap. Prints ratios, and rows for bench/run.

    sudo python3 bench/checkpoint.py [--big] [--build build] [--no-podman]

Ours: the agent checkpoints itself (leave_running) and forks 8 copies through the agent channel;
the numbers are the supervisor's own (checkpoint.created, restore.done, fork.created), so they
include the filesystem snapshot, the archive (zstd + sha256) and the pipe plumbing.
Raw: `criu dump --leave-running` of a holding agent's tree with the same flags, then `criu
restore` of those images (one, then 8 at once), each in a fresh network namespace.
Podman (Debian's 4.3.1 with its runc, which runs the `criu` on PATH: the same criu 4.2.1): the
agent in a container of the runtime image (images/build's tarball, `podman import`ed), `podman
container checkpoint --leave-running --export` (zstd), then `podman container restore --import`
into a new container, then 8 such restores at once; wall times of the podman commands.
Many files: an agent with 100,000 files of 1.5 KB in its workspace (10,000 with BENCH_QUICK), left
alone or writing 500 new ones a second, checkpointed three times leaving it running: the median
pause against `cp -a` of the same workspace.
"""
import argparse
import contextlib
import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import _rows
from _rows import QUICK

ROOT = pathlib.Path(__file__).resolve().parent.parent
SDK = ROOT / "sdk" / "python" / "sandboxer"

COPY_HOLD_S = 8
KSM_AT_S = 60  # the KSM run: the copies' memory this long after the fork
AGENT = r'''
import os, sys, time
COPY_HOLD_S = float(sys.argv[4]) if len(sys.argv) > 4 else %d
heap = bytearray(os.urandom(int(sys.argv[2]) << 20))
if sys.argv[1] == "hold":
    print("ready", flush=True)
    time.sleep(600)
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ch = agent.Channel()
if ch.checkpoint("bench", leave_running=True).get("copy"):
    sys.exit(0)  # restored from the archive into a new box: that was the measurement
if ch.fork(int(sys.argv[3])).get("copy"):
    time.sleep(COPY_HOLD_S)  # each copy lives until its memory has arrived (restore.memory_complete)
''' % COPY_HOLD_S


def fork8_copies_s(fork):
    """A fork's copies' part: to all running, less its own checkpoint's pause (a fork of a live
    branch starts its copies as that pause ends), or the whole of a fork of a stored snapshot."""
    t = fork["timings_ms"]
    if "running" in t and "checkpoint" in t:
        return (t["running"] - t["checkpoint"]["freeze"]) / 1e3
    return t["total"] / 1e3


def journal(init_dir, state):
    out = subprocess.run([str(init_dir / "sandboxer"), "log", str(state), "--json"], capture_output=True,
                         check=True, timeout=120).stdout
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def box_memory(mb):
    """The memory ceiling: the default profile's 2G is too small for the 1 GB agent (its heap is
    built from a copy: twice the size at its peak). Each copy of a fork gets a group of its own
    with this ceiling; the raw criu run's holding box gets the same one, so both sides match."""
    return f"resources.memory={max(2, -(-mb * (FORK_N + 2) // 1024) + 1)}G"


def ts(e):
    from datetime import datetime, timezone
    return datetime.strptime(e["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


KSM = pathlib.Path("/sys/kernel/mm/ksm")


def ksm_pages_sharing():
    try:
        return int((KSM / "pages_sharing").read_text()) if (KSM / "run").read_text().strip() == "1" else None
    except OSError:
        return None


class KsmOn:
    """KSM running and scanning fast for the benchmark, the host's settings back afterwards."""
    keys = ("run", "pages_to_scan", "sleep_millisecs")

    def __enter__(self):
        self.saved = {}
        try:
            self.saved = {k: (KSM / k).read_text().strip() for k in self.keys}
            (KSM / "pages_to_scan").write_text("20000")
            (KSM / "sleep_millisecs").write_text("5")
            (KSM / "run").write_text("1")
            self.why = None
        except OSError as e:
            self.why = f"KSM cannot be turned on here: {e}"
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            try:
                (KSM / k).write_text(v)
            except OSError:
                pass


def copies_pss_mb():
    """The proportional set size of every process running a copy of the agent, summed: each page
    counted once however many copies share it (KSM's merged pages included)."""
    total = 0
    for d in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if b"COPY_HOLD_S" not in (d / "cmdline").read_bytes():
                continue
            for line in (d / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total / 1e6


def ours(bindir, tmp, mb, ksm_only=False):
    state = tmp / f"ours-{mb}{'-ksm' if ksm_only else ''}"
    env = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    # The agent starts with a clean environment: the SDK's path is handed on by name.
    # KSM: pages_sharing sampled while the copies run (KSM turned on for the run where it can be);
    # its copies are held past KSM_AT_S, when their memory is measured.
    ksm_base = ksm_pages_sharing()
    hold = [str(KSM_AT_S + 5)] if ksm_only else []
    p = subprocess.Popen([str(bindir / "sandboxer-init"), "--state-dir", str(state), "--set", box_memory(mb),
                          "--env", "SBX_AGENT_SDK", "--", sys.executable, "-c", AGENT, "run", str(mb), str(FORK_N),
                          *hold], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ksm_most = 0
    pss_at = fork_t0 = None
    deadline = time.monotonic() + 900
    while p.poll() is None and time.monotonic() < deadline:
        if ksm_base is not None:
            ksm_most = max(ksm_most, (ksm_pages_sharing() or 0) - ksm_base)
        if ksm_only and fork_t0 is None:
            try:
                fork = next((e for e in journal(bindir, state) if e["type"] == "fork.created"), None)
            except subprocess.CalledProcessError:
                fork = None
            if fork:  # from the fork request
                fork_t0 = ts(fork) - fork["timings_ms"]["total"] / 1e3
        if fork_t0 is not None and pss_at is None and time.time() - fork_t0 >= KSM_AT_S:
            pss_at = copies_pss_mb()
        time.sleep(0.2 if fork_t0 is not None or not ksm_only else 0.5)
    p.wait(timeout=60)
    ev = journal(bindir, state)
    if p.returncode != 0:
        ends = [f"{e.get('proc')} {e.get('reason')}" for e in ev if e["type"] == "proc.exited"]
        raise RuntimeError(f"sandboxer-init exited {p.returncode}" + (f" ({', '.join(ends)})" if ends else ""))
    if ksm_only:
        return {"ksm_shared_mb": ksm_most * 4096 / 1e6 if ksm_base is not None else None, "copies_pss_mb": pss_at}
    created = [e for e in ev if e["type"] == "checkpoint.created"]
    fork = next(e for e in ev if e["type"] == "fork.created")
    first = created[0]
    restores = [c["timings_ms"]["restore"] for c in fork["copies"]]
    # The fork's copies: from the fork request (fork.created's time less its total) to the last
    # copy's memory complete (lazy pages), and criu's own restore phases per copy.
    fork_copies = {c["branch"] for c in fork["copies"]}
    memory = [e for e in ev if e["type"] == "restore.memory_complete" and e["branch"] in fork_copies]
    copy_criu = [c["timings_ms"].get("criu", {}) for c in fork["copies"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    t = first["timings_ms"]
    criu = t.get("criu", {})
    profile = {"stop": t["stop"], "criu freezing": criu.get("freezing", 0), "criu frozen (dump)": criu.get("frozen", 0),
               "criu memdump": criu.get("memdump", 0), "criu memwrite (pages)": criu.get("memwrite", 0),
               "layer copy": t["snapshot"], "resume": t["freeze"] - t["stop"] - t["dump"] - t["snapshot"],
               "compress+hash+seal (after the pause)": t["compress"]}
    # One restore into a new box from the archive (import, verify, extract, restore): from the
    # command's start (wall clock) to restore.done's timestamp, as podman's is its command's time.
    t0 = time.time()
    p = subprocess.Popen([str(bindir / "sandboxer-init"), "--state-dir", str(tmp / f"ours-r-{mb}"), "--restore",
                          first["archive"]], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p.wait(timeout=900)
    rev = journal(bindir, tmp / f"ours-r-{mb}")
    done = next(e for e in rev if e["type"] == "restore.done")

    return {
        "dump_s": first["timings_ms"]["dump"] / 1e3,
        "checkpoint_total_s": first["timings_ms"]["total"] / 1e3,
        "freeze_s": first["timings_ms"]["freeze"] / 1e3,
        "archive_mb": first["sizes"]["compressed"] / 1e6,
        "images_mb": first["sizes"]["images"] / 1e6,
        "restore_s": done["timings_ms"]["restore"] / 1e3,
        "restore_from_archive_s": ts(done) - t0,
        # The copies' part (comparable with the criu CLI's restores of an existing dump): from the
        # end of the fork's own checkpoint pause to all copies running; and the whole, from the
        # agent's fork request (its checkpoint included) to all running.
        "fork8_s": fork8_copies_s(fork),
        "fork8_request_s": fork["timings_ms"].get("running", fork["timings_ms"]["total"]) / 1e3,
        "fork8_early": bool(fork.get("early")),
        "fork_copy_restore_mean_s": sum(restores) / len(restores) / 1e3,
        "pause_s": first.get("pause_ms", t["freeze"]) / 1e3,
        "profile_ms": profile,
        "pages_written": criu.get("pages_written", 0),
        "fork_lazy": sum(1 for c in fork["copies"] if c.get("lazy")),
        "fork_lazy_why": next((c["lazy_why"] for c in fork["copies"] if c.get("lazy_why")), None),
        "fork_copy_criu_restore_mean_ms": mean([c.get("restore", 0) for c in copy_criu]),
        "fork_copy_pages_restored_mean": mean([c.get("pages_restored", 0) for c in copy_criu]),
        "fork8_memory_s": (max(ts(e) for e in memory) - (ts(fork) - fork["timings_ms"]["total"] / 1e3))
                          if len(memory) == len(fork_copies) else None,
    }


# The box's own periodic snapshots share the chunk store: an agent of `mb` MiB of random bytes
# (nothing to compress) that replaces a twentieth of it once, between two periodic checkpoints.
STORE_AGENT = r'''
import json, os, sys, time
mb, period = int(sys.argv[1]), float(sys.argv[2])
heap = bytearray(os.urandom(mb << 20))
print(json.dumps({"ready": 1}), flush=True)
time.sleep(period * 1.5)
heap[: (mb << 20) // 20] = os.urandom((mb << 20) // 20)
print(json.dumps({"changed": (mb << 20) // 20}), flush=True)
time.sleep(600)
'''


def export_bytes(bindir, url, token_file, snap, base=None):
    """The bytes `sandboxer export` receives of `snap` (a delta against `base`, else the whole
    archive), through the box API, as a box that has `base` would be sent."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        out = pathlib.Path(d) / "snap"
        cmd = [str(bindir / "sandboxer"), "export", url, snap, str(out), "--token-file", str(token_file)]
        subprocess.run(cmd + (["--base", base] if base else []), check=True, capture_output=True, timeout=600)
        return out.stat().st_size


def store(bindir, tmp, mb):
    """Two periodic checkpoints around a change of mb/20: what the second added to the chunk store
    and the agent's pause, beside the whole archive (the first's size); and the second's export to
    a box that has the first (a delta) beside its whole archive."""
    state = tmp / f"store-{mb}"
    period = max(3, mb // 150)
    token_file = tmp / f"store-{mb}.token"
    token_file.write_text(secrets.token_hex(16) + "\n")
    token_file.chmod(0o600)
    p = subprocess.Popen([str(bindir / "sandboxer-init"), "--state-dir", str(state), "--set", box_memory(mb),
                          "--set", f"checkpoint.every={period}s", "--set", "checkpoint.keep=8", "--listen",
                          "127.0.0.1:0", "--token-file", str(token_file), "--", sys.executable,
                          "-c", STORE_AGENT, str(mb), str(period)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                ev = journal(bindir, state)
            except subprocess.CalledProcessError:  # no journal yet
                continue
            changed = [e for e in ev if e["type"] == "proc.message" and "changed" in e["message"]]
            ready = [e for e in ev if e["type"] == "proc.message" and "ready" in e["message"]]
            created = [e for e in ev if e["type"] == "checkpoint.created"]
            # checkpoint.keep prunes the oldest periodic snapshots while this waits: those are
            # left out (they are before the change, and the newest before it is kept).
            seq = {}
            for e in created:
                with contextlib.suppress(FileNotFoundError):
                    seq[e["snapshot"]] = json.loads((state / "snapshots" / f"{e['snapshot']}.json").read_text())["last_seq"]
            created = [e for e in created if e["snapshot"] in seq]
            if changed and ready:
                before = [e for e in created if ready[0]["seq"] <= seq[e["snapshot"]] < changed[0]["seq"]]
                after = [e for e in created if seq[e["snapshot"]] >= changed[0]["seq"]]
                if before and after:
                    full, inc = before[-1], after[0]
                    (listening,) = [e for e in ev if e["type"] == "server.listening"]
                    url = f"ws://127.0.0.1:{listening['port']}"
                    return {"added_mb": inc["sizes"]["added"] / 1e6, "archive_mb": full["sizes"]["compressed"] / 1e6,
                            "changed_mb": changed[0]["message"]["changed"] / 1e6, "pause_s": inc["pause_ms"] / 1e3,
                            "full_pause_s": full["pause_ms"] / 1e3, "total_s": inc["total_ms"] / 1e3,
                            "delta_mb": export_bytes(bindir, url, token_file, inc["snapshot"], full["snapshot"]) / 1e6,
                            "whole_mb": export_bytes(bindir, url, token_file, inc["snapshot"]) / 1e6}
        raise RuntimeError("no periodic checkpoint on each side of the change within 300 s")
    finally:
        p.terminate()
        p.wait(timeout=60)


def raw(bindir, tmp, mb):
    state = tmp / f"raw-{mb}"
    env = dict(os.environ, SBX_AGENT_SDK=str(SDK))
    box = subprocess.Popen([str(bindir / "sandboxer-init"), "--state-dir", str(state), "--set", box_memory(mb),
                            "--env", "SBX_AGENT_SDK", "--events", "-", "--",
                            sys.executable, "-c", AGENT, "hold", str(mb)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        for line in box.stdout:
            e = json.loads(line)
            # The agent's own line (its program text is in proc.started's argv too).
            if e["type"] == "proc.output" and e.get("data", "").startswith("ready"):
                break
            if e["type"] == "proc.exited":
                raise RuntimeError(f"the holding agent ended before it was ready: {e.get('reason')}")
        else:
            raise RuntimeError("the holding box ended before its agent was ready")
        ns_init = int(open(f"/proc/{box.pid}/task/{box.pid}/children").read().split()[0])
        agent_pid = int(open(f"/proc/{ns_init}/task/{ns_init}/children").read().split()[0])
        # The pipes crossing the tree's boundary, with the end the tree holds (launcher.hpp); ns-init's
        # reports (fd 4) are a socket whose peer is the supervisor's: external to criu, as the
        # supervisor's own dump names it (checkpointer.cpp).
        pipes = {}
        for pid, fd, end in ((ns_init, 3, "r"), (ns_init, 4, "w"), (agent_pid, 0, "r"), (agent_pid, 1, "w"),
                             (agent_pid, 2, "w"), (agent_pid, 3, "w"), (agent_pid, 4, "r")):
            pipes[os.readlink(f"/proc/{pid}/fd/{fd}")] = end
        sockets = [link[len("socket:["):-1] for link in pipes if link.startswith("socket:[")]
        img = tmp / f"raw-img-{mb}"
        img.mkdir()
        t0 = time.monotonic()
        subprocess.run(["criu", "dump", "-t", str(ns_init), "-D", str(img), "-o", "dump.log", "--external", "mnt[]",
                        "--external", "mnt[/workspace]:workspace", "--external", "mnt[/tmp]:tmp", "--external",
                        "mnt[/run]:run", "--manage-cgroups=ignore", "--tcp-established", "--network-lock", "skip",
                        "--file-locks", "--leave-running", *[a for ino in sockets for a in ("--external", f"unix[{ino}]")]],
                       check=True, timeout=900)
        dump_s = time.monotonic() - t0
        # criu restores onto the mount points of the tree's root, which the supervisor's own
        # checkpoint writes into a snapshot (sandbox::copy_root_top): the branch's root is a tmpfs in
        # its mount namespace, so its root/ on disk is empty. Read the same from the live root.
        top = tmp / f"raw-root-{mb}"
        top.mkdir()
        with os.scandir(f"/proc/{ns_init}/root") as entries:
            for e in entries:
                if e.is_symlink():
                    os.symlink(os.readlink(e.path), top / e.name)
                elif e.is_dir(follow_symlinks=False):
                    (top / e.name).mkdir()

        def restore_many(n):
            procs, keep = [], []
            t = time.monotonic()
            for i in range(n):
                d = tmp / f"raw-copy-{mb}-{n}-{i}"
                shutil.copytree(top, d / "root", symlinks=True)
                for sub in ("workspace", "tmp", "run"):
                    shutil.copytree(state / "branches" / "main" / sub, d / sub, symlinks=True)
                # The state dir is masked in the branch's view: under /tmp, its mount point must
                # exist in the copy's own /tmp (as the supervisor does it).
                if str(state).startswith("/tmp/"):
                    (d / "tmp" / str(state)[5:]).mkdir(parents=True, exist_ok=True)
                args, fds = [], []
                for k, (link, _) in enumerate(pipes.items()):
                    if link.startswith("socket:["):
                        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                        r, w = a.detach(), b.detach()
                    else:
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


FORK_N = 8  # copies in a fork
PODMAN_TAG = "localhost/sandboxer/agent:bench"
# Debian's podman sets, for root, RLIMIT_NOFILE 1048576 and RLIMIT_NPROC 4194304 in the container;
# where the host's hard limits are lower and there is no CAP_SYS_RESOURCE (this VM), runc fails
# with "error setting rlimit type 7: operation not permitted". Limits below the host's avoid it.
PODMAN_RUN = ["--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


class PodmanError(Exception):
    pass


# runc where it is installed: crun (podman's first choice) refuses a host whose cgroup v2 mount
# holds no controllers while v1 holds them all ("cgroups in hybrid mode not supported"), as here.
PODMAN_RUNTIME = ["--runtime", "runc"] if shutil.which("runc") else []


def podman(*args, timeout=900):
    p = subprocess.run(["podman", *PODMAN_RUNTIME, *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        lines = [l for l in (p.stderr or p.stdout).splitlines() if l.strip()]
        raise PodmanError(f"podman {' '.join(args[:2])}: {lines[-1] if lines else f'exit {p.returncode}'}")
    return p.stdout


def podman_image(bindir, tmp):
    """The runtime image (scripts/bundle + images/build, the same as images/docker-image makes for
    Docker), imported into podman. Quick runs reuse an image already there."""
    if QUICK and subprocess.run(["podman", "image", "exists", PODMAN_TAG]).returncode == 0:
        return
    bundle, tar = tmp / "bundle", tmp / "agent.tar"
    subprocess.run([str(ROOT / "scripts" / "bundle"), str(bindir), str(bundle)], check=True, capture_output=True)
    b = subprocess.run([str(ROOT / "images" / "build"), "--bundle", str(bundle), "--out", str(tar)],
                       capture_output=True, text=True)
    if b.returncode != 0:
        raise PodmanError(f"images/build: {(b.stderr.strip().splitlines() or ['exit %d' % b.returncode])[-1]}")
    # The previous run's image goes first, so that runs do not pile up untagged images.
    subprocess.run(["podman", "rmi", "-f", PODMAN_TAG], capture_output=True)
    podman("import", "--change", "WORKDIR /workspace", str(tar), PODMAN_TAG)
    tar.unlink()
    shutil.rmtree(bundle)


def podman_criu_version(tmp):
    """The criu version podman's runc runs, read from the dump.log a kept checkpoint leaves (the
    measured runs do not keep theirs)."""
    name = f"sbx-bench-{os.getpid()}-criu"
    try:
        podman("run", "-d", "--name", name, *PODMAN_RUN, PODMAN_TAG, "sleep", "600")
        podman("container", "checkpoint", "--keep", f"--export={tmp / 'criu-version.tar.zst'}", name)
        log = pathlib.Path(podman("inspect", "--format", "{{.StaticDir}}", name).strip()) / "dump.log"
        return next((l.split("Version:", 1)[1].split()[0] for l in log.read_text().splitlines() if "Version:" in l), "?")
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)


def podman_peer(tmp, mb, n):
    """podman checkpoint --export / restore --import of the same agent in the runtime image;
    podman's OCI runtime (runc) runs `criu` from PATH: the same criu as ours and the raw CLI's."""
    name = f"sbx-bench-{os.getpid()}-{mb}"
    names = [name]
    try:
        podman("run", "-d", "--name", name, *PODMAN_RUN, PODMAN_TAG, "python3", "-c", AGENT, "hold", str(mb))
        deadline = time.monotonic() + 300
        while "ready" not in podman("logs", name):
            if time.monotonic() > deadline:
                raise PodmanError(f"podman run: the agent did not print ready in 300 s")
            time.sleep(0.1)
        archive = tmp / f"podman-{mb}.tar.zst"
        t0 = time.monotonic()
        stats = json.loads(podman("container", "checkpoint", "--leave-running", "--print-stats",
                                  f"--export={archive}", name))
        dump_s = time.monotonic() - t0
        runtime_dump_s = stats["container_statistics"][0]["runtime_checkpoint_duration"] / 1e6
        names.append(f"{name}-r")
        t0 = time.monotonic()
        stats = json.loads(podman("container", "restore", "--print-stats", f"--import={archive}", "--name", names[-1]))
        restore_s = time.monotonic() - t0
        runtime_restore_s = stats["container_statistics"][0]["runtime_restore_duration"] / 1e6
        fork = [f"{name}-f{i}" for i in range(n)]
        names += fork
        t0 = time.monotonic()
        procs = [subprocess.Popen(["podman", "container", "restore", f"--import={archive}", "--name", f],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for f in fork]
        errs = [p.communicate(timeout=900)[1] for p in procs]
        fork_s = time.monotonic() - t0
        bad = [e for p, e in zip(procs, errs) if p.returncode != 0]
        if bad:
            raise PodmanError(f"podman container restore (fork of {n}): {len(bad)} failed: "
                              f"{(bad[0].strip().splitlines() or ['?'])[-1]}")
        return {"dump_s": dump_s, "runtime_dump_s": runtime_dump_s, "archive_mb": archive.stat().st_size / 1e6,
                "restore_s": restore_s, "runtime_restore_s": runtime_restore_s, "fork_s": fork_s}
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", *names], capture_output=True)


def criu_version():
    out = subprocess.run(["criu", "--version"], capture_output=True, text=True).stdout
    return next((l.split()[1] for l in out.splitlines() if l.startswith("Version:")), "?")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also the ~1 GB agent")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--no-podman", action="store_true", help="leave podman out")
    a = ap.parse_args()
    bindir = pathlib.Path(a.build) / "bin"
    if os.geteuid() != 0:
        print("checkpoint: skipped (criu needs root)")
        _rows.emit("checkpoint", "(the whole benchmark)", "", None, note="not run: criu needs root")
        return
    if not shutil.which("criu"):
        print("checkpoint: skipped (no criu on PATH; scripts/install-criu)")
        _rows.emit("checkpoint", "(the whole benchmark)", "", None, note="not run: no criu on PATH (scripts/install-criu)")
        return
    sizes = [50] + ([1024] if a.big else [])
    n = FORK_N
    podman_ready = None
    with tempfile.TemporaryDirectory(prefix="sbx-bench-") as t:
        tmp = pathlib.Path(t)
        if a.no_podman:
            podman_ready = "left out (--no-podman)"
        elif not shutil.which("podman"):
            podman_ready = "podman not installed (bench/run installs Debian's)"
        else:
            try:
                podman_image(bindir, tmp)
            except (PodmanError, subprocess.CalledProcessError) as e:
                podman_ready = f"could not make the podman image: {e}"
        ours_criu = criu_version()
        if not podman_ready:
            try:
                theirs = podman_criu_version(tmp)
            except PodmanError as e:
                theirs = None
                podman_ready = f"podman checkpoint does not run here: {e}"
            if theirs and theirs != ours_criu:
                podman_ready = f"podman's runc runs criu {theirs}, not {ours_criu} as ours does"
        print(f"# checkpoint: criu {ours_criu} (ours and the raw CLI); podman: "
              f"{podman_ready or podman('--version').strip() + ' with ' + podman('info', '--format', '{{.Host.OCIRuntime.Name}}').strip() + ', criu ' + theirs + ' (its dump.log)'}")
        for mb in sizes:
            one_size(bindir, tmp, mb, n, podman_ready)
        many_files_rows(bindir, tmp)


MANY_FILES = r'''
import os, sys, time
ws = os.environ["SANDBOXER_WORKSPACE"]
for i in range(int(sys.argv[1]) // 1000):
    os.mkdir(f"{ws}/d{i}")
    for j in range(1000):
        with open(f"{ws}/d{i}/f{j}", "wb") as f:
            f.write(b"x" * 1500)
print("files" + "-made", flush=True)
rate = int(sys.argv[2])  # new files a second from then on
os.mkdir(f"{ws}/new")
n = 0
while True:
    t = time.monotonic()
    for _ in range(rate // 10):
        with open(f"{ws}/new/{n}", "wb") as f:
            f.write(b"y" * 1500)
        n += 1
    time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))
'''


def many_files(bindir, tmp, n, rate):
    """An agent with `n` files of 1.5 KB in its workspace (a node_modules), writing `rate` new
    ones a second from then on, checkpointed three times (leaving it running): its pauses
    (pause_ms), and the copy made beforehand (timings_ms.precopy). The peer: `cp -a` of the same
    workspace, what copying the layer while the agent is stopped takes by itself."""
    state = tmp / f"many-{rate}"
    log_path = tmp / f"many-{rate}.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen([str(bindir / "sandboxer"), "run", "--state-dir", str(state), "--listen", "127.0.0.1:0",
                              "--", sys.executable, "-c", MANY_FILES, str(n), str(rate)],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        url, deadline = None, time.monotonic() + 900
        while not url:
            text = log_path.read_text(errors="replace")
            if "files-made" in text:
                url = next(w for w in text.split() if w.startswith("ws://"))
            elif p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not make its files: {text[-300:]}")
            else:
                time.sleep(0.5)
        time.sleep(2.5)  # past the window in which a file's times are not trusted
        for i in range(3):
            subprocess.run([str(bindir / "sandboxer"), "checkpoint", url, "--name", f"many-{i}"], check=True,
                           capture_output=True, timeout=600)
            time.sleep(2)
        created = [e for e in journal(bindir, state) if e["type"] == "checkpoint.created"]
        t0 = time.monotonic()
        subprocess.run(["cp", "-a", str(state / "branches/main/workspace"), str(tmp / f"many-{rate}-cp")], check=True)
        cp_s = time.monotonic() - t0
    finally:
        subprocess.run([str(bindir / "sandboxer"), "down", str(state)], capture_output=True, timeout=300)
        p.wait(timeout=300)
        shutil.rmtree(tmp / f"many-{rate}-cp", ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    pauses = [e["pause_ms"] / 1e3 for e in created]
    return {"pause_s": sorted(pauses)[len(pauses) // 2], "pauses": pauses, "cp_s": cp_s,
            "precopy_s": [e["timings_ms"].get("precopy", 0) / 1e3 for e in created],
            "resyncs": [e["timings_ms"].get("precopy_resyncs") for e in created]}


def many_files_rows(bindir, tmp):
    n = 10_000 if QUICK else 100_000
    for rate in (0, 500):
        what = (f"agent paused by a checkpoint, {n:,} files of 1.5 KB in its workspace, "
                + ("left alone" if not rate else f"{rate} new files a second all the while") + ", median of 3")
        try:
            m = many_files(bindir, tmp, n, rate)
        except Exception as e:  # noqa: BLE001 - any failure becomes the row's note
            _rows.emit("checkpoint", what, "s", None, "cp -a of that workspace", None, note=f"failed: {failure(e)}")
            continue
        print(f"# {what}: paused {m['pauses']} s, copied beforehand in {m['precopy_s']} s "
              f"(syncs while running {m['resyncs']}); cp -a {m['cp_s']:.2f} s")
        _rows.emit("checkpoint", what, "s", m["pause_s"], "cp -a of that workspace", m["cp_s"],
                   note=f"pauses {', '.join(f'{x:.2f}' for x in m['pauses'])} s; the layer copied beforehand while the "
                        f"agent ran in {', '.join(f'{x:.1f}' for x in m['precopy_s'])} s")


def failure(e):
    """One line saying why a part did not run (for the table's note)."""
    if isinstance(e, subprocess.CalledProcessError):
        return f"{os.path.basename(str(e.cmd[0]))} exited {e.returncode}"
    return f"{type(e).__name__}: {e}" if not isinstance(e, (RuntimeError, PodmanError)) else str(e)


def one_size(bindir, tmp, mb, n, podman_ready):
    o = r = pm = None
    why_ours = why_raw = None
    why_pm = podman_ready
    try:
        o = ours(bindir, tmp, mb)
        # KSM in a run of its own: ksmd scanning fast takes a core, which would slow the timings.
        with KsmOn() as k:
            o.update(ours(bindir, tmp, mb, ksm_only=True))
            o["ksm_why"] = k.why
    except Exception as e:  # noqa: BLE001 - any failure becomes the row's note
        why_ours = f"ours failed: {failure(e)}"
    try:
        r = raw(bindir, tmp, mb)
        if not r["ok"]:
            why_raw = "some raw criu restores failed"
    except Exception as e:  # noqa: BLE001
        why_raw = f"raw criu failed: {failure(e)}"
    if not why_pm:
        try:
            pm = podman_peer(tmp, mb, n)
        except (PodmanError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            why_pm = f"podman failed here: {e}"
    print(f"== agent with {mb} MB of heap")
    if o:
        print(f"   ours: dump {o['dump_s']:.3f}s (freeze {o['freeze_s']:.3f}s, checkpoint with archive "
              f"{o['checkpoint_total_s']:.3f}s, images {o['images_mb']:.0f} MB, archive {o['archive_mb']:.0f} MB)")
        print(f"         agent paused {o['pause_s']:.3f}s; per phase (ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in o["profile_ms"].items()) + f"; {o['pages_written']} pages written")
        print(f"         fork copies: {o['fork_lazy']} of {n} lazy"
              + (f" (eager: {o['fork_lazy_why']})" if o["fork_lazy_why"] else "")
              + f", criu's restore {o['fork_copy_criu_restore_mean_ms']:.1f} ms and "
              f"{o['fork_copy_pages_restored_mean']:.0f} pages restored by criu per copy (mean), all memory complete "
              + (f"{o['fork8_memory_s']:.3f}s" if o["fork8_memory_s"] is not None else "(not reported by every copy)")
              + " from the fork request")
        print(f"         KSM: " + (f"{o['ksm_shared_mb']:.0f} MB of the {n} copies' memory shared at most (pages_sharing), "
                                   f"of {n * mb} MB of heap" if o["ksm_shared_mb"] is not None else o["ksm_why"] or "not running")
              + (f"; the copies' PSS {KSM_AT_S} s after the fork: {o['copies_pss_mb']:.0f} MB"
                 if o.get("copies_pss_mb") is not None else ""))
        print(f"         restore {o['restore_s']:.3f}s (a new box from the archive, verify and extract included: "
              f"{o['restore_from_archive_s']:.3f}s), fork of {n} {o['fork8_s']:.3f}s (copies), "
              f"{o['fork8_request_s']:.3f}s from the agent's fork request to all running "
              f"({'copies started before the archive was sealed' if o['fork8_early'] else 'after the seal'})")
    else:
        print(f"   {why_ours}")
    if r:
        print(f"   raw criu: dump {r['dump_s']:.3f}s, restore {r['restore_s']:.3f}s, fork of {n} {r['fork8_s']:.3f}s"
              f"{'' if r['ok'] else ' (some raw restores FAILED)'}")
    else:
        print(f"   {why_raw}")
    if o and r:
        print(f"   ratio ours/raw: agent paused {o['pause_s'] / r['dump_s']:.2f}, dump {o['dump_s'] / r['dump_s']:.2f}, restore {o['restore_s'] / r['restore_s']:.2f}, "
              f"fork of {n} {o['fork8_s'] / r['fork8_s']:.2f}")
    if pm:
        print(f"   podman: checkpoint --export {pm['dump_s']:.3f}s (runc's part {pm['runtime_dump_s']:.3f}s, "
              f"archive {pm['archive_mb']:.0f} MB), restore --import {pm['restore_s']:.3f}s (runc's part "
              f"{pm['runtime_restore_s']:.3f}s), {n} restores --import at once {pm['fork_s']:.3f}s")
        if o:
            print(f"   ratio ours/podman: checkpoint {o['checkpoint_total_s'] / pm['dump_s']:.2f}, restore "
                  f"{o['restore_from_archive_s'] / pm['restore_s']:.2f}, fork of {n} {o['fork8_s'] / pm['fork_s']:.2f}, "
                  f"archive size {o['archive_mb'] / pm['archive_mb']:.2f}")
    else:
        print(f"   podman: {why_pm}")
    st = why_st = None
    try:
        st = store(bindir, tmp, mb)
        print(f"   chunk store: after {st['changed_mb']:.0f} MB of {mb} MB changed, a periodic checkpoint added "
              f"{st['added_mb']:.1f} MB (a whole archive: {st['archive_mb']:.0f} MB, ratio "
              f"{st['added_mb'] / st['archive_mb']:.3f}); agent paused {st['pause_s']:.3f}s (the first, whole: "
              f"{st['full_pause_s']:.3f}s), stored {st['total_s']:.3f}s after it began; its export to a box that "
              f"has the first: {st['delta_mb']:.1f} MB (its whole archive: {st['whole_mb']:.0f} MB)")
    except Exception as e:  # noqa: BLE001
        why_st = f"chunk store failed: {failure(e)}"
        print(f"   {why_st}")
    agent = f"{mb} MB agent"
    _rows.emit("checkpoint", f"store growth of a periodic checkpoint after {mb // 20} MB changed, {agent}", "MB",
               st["added_mb"] if st else None, "a whole archive", st["archive_mb"] if st else None, note=why_st)
    _rows.emit("checkpoint", f"agent paused by a periodic checkpoint after {mb // 20} MB changed, {agent}", "s",
               st["pause_s"] if st else None, "the first (whole) one", st["full_pause_s"] if st else None, note=why_st)
    _rows.emit("checkpoint", f"export to a box that has the parent snapshot (a delta, `export --base`), {agent}",
               "MB", st["delta_mb"] if st else None, "the whole archive", st["whole_mb"] if st else None,
               note=why_st)
    ov = lambda k: o[k] if o else None
    rv = lambda k: r[k] if r else None
    pv = lambda k: pm[k] if pm else None
    both = lambda a, b: "; ".join(x for x in (a, b) if x) or None
    for what, k, rk in ((f"agent paused by a checkpoint, {agent}", "pause_s", "dump_s"),
                        (f"dump (criu's part, leave running), {agent}", "dump_s", "dump_s"),
                        (f"restore (criu's part), {agent}", "restore_s", "restore_s"),
                        (f"fork of {n} (all running), {agent}", "fork8_s", "fork8_s")):
        _rows.emit("checkpoint", what, "s", ov(k), "criu CLI", rv(rk), note=both(why_ours, why_raw))
    _rows.emit("checkpoint", f"fork of {n} of the live agent, from its fork request to all running (dump + copies), "
               f"{agent}", "s", ov("fork8_request_s"), "criu CLI dump + restores",
               r["dump_s"] + r["fork8_s"] if r else None, note=both(why_ours, why_raw))
    _rows.emit("checkpoint", f"fork of {n}: all copies' memory complete (lazy pages), {agent}", "s",
               ov("fork8_memory_s"), note=why_ours)
    _rows.emit("checkpoint", f"fork of {n}: memory shared by KSM (pages_sharing at most), {agent}", "MB",
               ov("ksm_shared_mb"), better="higher", note=why_ours or (o["ksm_why"] if o else None))
    _rows.emit("checkpoint", f"fork of {n}: the copies' memory {KSM_AT_S} s after the fork (sum of PSS), KSM on, {agent}",
               "MB", ov("copies_pss_mb"), f"{n} x the heap", n * mb * 1.048576,
               note=why_ours or (o["ksm_why"] if o else None))
    for what, unit, k, peer, pk in (
            (f"checkpoint to one archive (dump, files, compress), {agent}", "s", "checkpoint_total_s",
             "podman checkpoint --export", "dump_s"),
            (f"restore a new box from the archive, {agent}", "s", "restore_from_archive_s", "podman restore --import",
             "restore_s"),
            (f"fork of {n} (all running), {agent}", "s", "fork8_s", f"podman restore --import x{n}", "fork_s"),
            (f"archive size, {agent}", "MB", "archive_mb", "podman --export", "archive_mb")):
        _rows.emit("checkpoint", what, unit, ov(k), peer, pv(pk), note=both(why_ours, why_pm))

if __name__ == "__main__":
    main()
