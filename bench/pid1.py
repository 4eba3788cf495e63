#!/usr/bin/env python3
"""PID-1 overhead: `sandboxer-init -- /bin/true` as a whole process against tini and dumb-init,
in one run, interleaved so that machine noise hits every peer alike; and the supervisor's own
peak RSS (VmHWM) beside theirs while the agent sleeps.

Prints one table: what, our figure, each peer's figure, ratio; and rows for bench/run
(bench/_rows.py). Not a test: nothing asserts."""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("SANDBOXER_BIN", os.path.join(ROOT, "build", "bin"))
INIT = os.path.join(BIN, "sandboxer-init")
RUNS = int(os.environ.get("BENCH_RUNS", "5" if _rows.QUICK else "40"))


def commands(state):
    c = {
        "sandboxer-init": [INIT, "--state-dir", state, "--", "/bin/true"],
        "sandboxer-init (flat)": [INIT, "--state-dir", state, "--set", "isolation.namespaces=false", "--", "/bin/true"],
        "sandboxer-init (state dir reused)": [INIT, "--state-dir", state, "--", "/bin/true"],
        "tini": ["tini", "-s", "--", "/bin/true"],
        "dumb-init": ["dumb-init", "/bin/true"],
        "bare /bin/true": ["/bin/true"],
    }
    # As PID 1 of a new pid namespace, as in a container: both inits under the same unshare.
    if shutil.which("unshare") and os.geteuid() == 0:
        for name in ("sandboxer-init", "tini"):
            c[name + " (PID 1 of a pid ns)"] = ["unshare", "--pid", "--fork", *c[name]]
    return {k: v for k, v in c.items() if _present(v)}


def _present(cmd):
    exe = cmd[3] if cmd[0] == "unshare" else cmd[0]  # after unshare --pid --fork
    return bool(shutil.which(exe) or os.path.exists(exe))


def time_runs(cmds, state_root):
    """Medians of RUNS interleaved runs. Each run of ours gets a state dir of its own, as a new
    container or `sandboxer run` does (creating its ~24 files and directories is part of the
    start), except "(state dir reused)", which starts where its run before left."""
    times = {k: [] for k in cmds}
    for i in range(RUNS):
        for n, (name, cmd) in enumerate(cmds.items()):
            state = f"{state_root}/reused" if name.endswith("(state dir reused)") else f"{state_root}/{i}-{n}"
            cmd = [a.replace("@STATE@", state) for a in cmd]
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_rss_kib(cmd):
    """(VmHWM, RssAnon) of the supervisor process itself, read while its agent sleeps: the peak of
    all its resident pages (most are the shared libraries' file pages, shared with every other
    process that maps them), and the anonymous ones that are its alone."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.6)
    got = {}
    with open(f"/proc/{p.pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "RssAnon:")):
                got[line.split(":")[0]] = int(line.split()[1])
    p.wait()
    return got.get("VmHWM"), got.get("RssAnon")


def dirty_runs(state_root, runs):
    """/bin/true under the init and under tini while another process has left 200 MB unwritten on
    the state dir's filesystem (a busy host's disk): an end that syncs that filesystem waits for
    all of it. Medians of `runs`, interleaved."""
    blob = b"\x5a" * (200 << 20)
    dirty = os.path.join(state_root, "dirty.bin")
    cmds = {"sandboxer-init": [INIT, "--state-dir", "@STATE@", "--", "/bin/true"],
            "tini": ["tini", "-s", "--", "/bin/true"]}
    times = {k: [] for k in cmds if _present(cmds[k])}
    for i in range(runs):
        for name in times:
            with open(dirty, "wb") as f:
                f.write(blob)
            cmd = [a.replace("@STATE@", f"{state_root}/dirty-{i}") for a in cmds[name]]
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - t0)
            os.unlink(dirty)
    return {k: statistics.median(v) for k, v in times.items()}


def big_journal_runs(state_root, runs):
    """/bin/true under the init in a state dir whose journal's active segment already holds 15 MB
    of an agent's output (a box restarted after a busy run: the start checks every line of that
    segment), against tini. Medians of `runs`, interleaved."""
    state = os.path.join(state_root, "big-journal")
    agent = "import os\nline = b'x' * 4000 + b'\\n'\nfor _ in range(3800): os.write(1, line)\n"
    subprocess.run([INIT, "--state-dir", state, "--", sys.executable, "-c", agent], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    cmds = {"sandboxer-init": [INIT, "--state-dir", state, "--", "/bin/true"], "tini": ["tini", "-s", "--", "/bin/true"]}
    return medians_of({k: v for k, v in cmds.items() if _present(v)}, runs)


def medians_of(cmds, runs, check=True):
    """Each command's median time as a whole process, over `runs` rounds that run each once in turn."""
    times = {k: [] for k in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=check)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def exec_costs():
    """The exec every branch pays for its ns-init: sandboxer-ns-init (the small program) against
    sandboxer-init's own --ns-init mode, each as a whole process that exits at once (a bad
    argument; --version for sandboxer-init), beside /bin/true."""
    small = os.path.join(BIN, "sandboxer-ns-init")
    cmds = {"sandboxer-ns-init": [small, "--bench"], "sandboxer-init --version": [INIT, "--version"],
            "bare /bin/true": ["/bin/true"]}
    return medians_of({k: v for k, v in cmds.items() if os.path.exists(v[0])}, RUNS, check=False)


def report_against_tini(med, tag, condition):
    """Prints the medians of ours and tini under one condition, and emits its row."""
    for name, v in med.items():
        print(f"{'run /bin/true under ' + name + ', ' + tag:44} {v * 1000:10.2f}ms")
    if "tini" in med:
        _rows.emit("pid1", "/bin/true under the init, whole process, " + condition, "ms", med["sandboxer-init"] * 1000,
                   "tini", med["tini"] * 1000)


def main():
    state_root = tempfile.mkdtemp(prefix="sbx-bench-")
    # Our supervisor as PID 1 of a pid namespace writes its health file (for a container's
    # HEALTHCHECK): here, not over the host's /run/sandboxer/init.json.
    os.environ["SANDBOXER_HEALTH_FILE"] = os.path.join(state_root, "init.json")
    cmds = commands("@STATE@")
    med = time_runs(cmds, state_root)
    base = med["sandboxer-init"]
    print(f"# pid1: median of {RUNS} interleaved runs each; {os.uname().nodename}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'what':44} {'figure':>12} {'ratio (ours / peer)':>20}")
    for name, v in med.items():
        # Each peer against ours run the same way (a pid namespace's rows against each other).
        ours = "sandboxer-init (PID 1 of a pid ns)" if name.endswith("pid ns)") else "sandboxer-init"
        ratio = "" if name.startswith("sandboxer-init") else f"{med.get(ours, base) / v:.2f}"
        print(f"{'run /bin/true under ' + name:44} {v * 1000:10.2f}ms {ratio:>20}")
    what = f"/bin/true under the init, whole process, median of {RUNS}"
    for ours, label in (("sandboxer-init", what), ("sandboxer-init (flat)", what + ", no namespaces"),
                        ("sandboxer-init (state dir reused)", what + ", the state dir of the run before"),
                        ("sandboxer-init (PID 1 of a pid ns)", what + ", as PID 1 of a pid namespace")):
        if ours not in med:
            continue
        peers = ("tini", "dumb-init", "bare /bin/true") if ours == "sandboxer-init" else ("tini",)
        if ours.endswith("pid ns)"):
            peers = ("tini (PID 1 of a pid ns)",)
        for peer in peers:
            if peer in med:
                _rows.emit("pid1", label, "ms", med[ours] * 1000, peer, med[peer] * 1000)
            else:
                _rows.emit("pid1", label, "ms", med[ours] * 1000, peer, None, note=f"{peer} not on PATH")
    report_against_tini(dirty_runs(state_root, 3 if _rows.QUICK else 10), "200 MB dirty",
                        "while 200 MB another process wrote is not yet on disk")
    report_against_tini(big_journal_runs(state_root, 3 if _rows.QUICK else 10), "15 MB journal",
                        "in a state dir whose journal's active segment holds 15 MB (a restart after a busy agent)")
    ex = exec_costs()
    if "sandboxer-ns-init" in ex and "sandboxer-init --version" in ex:
        for name, v in ex.items():
            print(f"{'exec of ' + name + ', whole':44} {v * 1000:10.2f}ms")
        _rows.emit("pid1", "ns-init's exec, whole process (sandboxer-ns-init vs sandboxer-init's own mode)", "ms",
                   ex["sandboxer-ns-init"] * 1000, "sandboxer-init --version", ex["sandboxer-init --version"] * 1000)
    sleep = lambda c: [a if a != "/bin/true" else "sleep" for a in c] + ["1"]
    rss = {}
    for name in ("sandboxer-init", "tini", "dumb-init"):
        if name in cmds:
            cmd = [a.replace("@STATE@", f"{state_root}/rss") for a in cmds[name]]
            rss[name] = peak_rss_kib(sleep(cmd))
    for name, (hwm, anon) in rss.items():
        ours_hwm, ours_anon = rss["sandboxer-init"]
        ratio = "" if name == "sandboxer-init" else f"{ours_hwm / hwm:.2f}"
        print(f"{'peak RSS of ' + name:44} {hwm / 1024:10.2f}MiB {ratio:>20}")
        ratio = "" if name == "sandboxer-init" else f"{ours_anon / anon:.2f}"
        print(f"{'anonymous RSS of ' + name:44} {anon / 1024:10.2f}MiB {ratio:>20}")
        if name != "sandboxer-init":
            _rows.emit("pid1", "the init's own peak RSS (VmHWM), agent sleeping", "MiB", ours_hwm / 1024, name,
                       hwm / 1024)
            _rows.emit("pid1", "the init's own anonymous memory (RssAnon), agent sleeping", "MiB", ours_anon / 1024,
                       name, anon / 1024)
    shutil.rmtree(state_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
