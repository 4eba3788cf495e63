#!/usr/bin/env python3
"""Checkpoint and fork across containers (issue 6): a live agent in container A is checkpointed
(`sandboxer checkpoint`), then forked into two new containers (`sandboxer fork --host docker -n
2`: two idle containers of A's image and profile started while the snapshot streams out of A's
API into theirs, read once, then a criu restore in each). Beside it, in the same run, on the same image, agent and criu:
- Docker's own live checkpoint (experimental; runc drives the same criu): `docker checkpoint
  create --leave-running` of the agent under tini, then for each copy `docker create`, the
  checkpoint copied into that container's own dir under dockerd's data root (Docker has no
  other way to restore a checkpoint into another container: `--checkpoint-dir` is refused at
  start), and `docker start --checkpoint`, the two copies side by side as sandboxer's are, each copy's
  checkpoint made distinct by one extra file: dockerd uploads it to containerd by digest, and a
  second upload of the same bytes fails ("content ... already exists"). The containers run with
  `--network none`: in the host's network namespace the copies' listener would clash with the
  original's, which sandboxer avoids by giving each copy a namespace of its own;
- what a host without live fork does instead: `docker run` of two fresh containers of the
  same image and agent under tini until both listen (a cold start: the agent's memory is lost).
A private dockerd (scripts/dockerd, DOCKERD_EXPERIMENTAL=1) runs for the measurement and is
stopped after.

Rows (medians of BENCH_RUNS runs, default 5; one table per agent heap in BENCH_HEAP_MB, default
"0,100": the counting agent alone, ~10 MB RSS, and with 100 MB of os.urandom heap), wall-clock
as a script sees it (CLI included):
- checkpoint in A: `sandboxer checkpoint URL` (stop, criu dump, copy of the layer, resume,
  compress);
- fork into 2 containers: `sandboxer fork URL --snapshot S -n 2 --host docker` until both copies
  run (restore.done in each);
- checkpoint + fork, the figure of issue 6, against the cold start of two containers;
- the archive's size.

The two-dockerd case (issue 17; BENCH_REMOTE=0 leaves it out): a second dockerd in a network
namespace of its own, reached over a veth pair only (DOCKER_HOST=tcp://ADDR:2375, as
tests/e2e/test_docker_remote.py makes it), the image moved there by docker save | load. The
agent (the same counter, its code inline: nothing bound in, which a box on another machine could
not have) runs in A on the first dockerd; rows, beside the same figures on the first dockerd
alone in the same run:
- checkpoint + fork into 2 containers on the other dockerd (the CLI pointed at it);
- migrate A to the other dockerd: checkpoint held, one container there, restore, A ended.

Prints its table; with SANDBOXER_BENCH_ROWS=FILE also appends one JSON line per figure (the
shared row format bench/run gathers). Not a test: nothing asserts. Needs root (dockerd)."""
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import _common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("SANDBOXER_BUILD", os.path.join(ROOT, "build"))
CLI = os.path.join(BUILD, "bin", "sandboxer")
RUNS = int(os.environ.get("BENCH_RUNS", "5"))
# The agent's heap (os.urandom, so it does not compress), one table per size.
HEAPS = [int(x) for x in os.environ.get("BENCH_HEAP_MB", "0,100").split(",")]
TAG = "sandboxer/agent:bench"
AGENT = os.path.join(ROOT, "tests", "e2e")
LISTENER = "import socket,time\ns=socket.socket()\ns.bind(('127.0.0.1',{port}))\ns.listen()\ntime.sleep(600)\n"


free_port = _common.free_port


def accepts(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def run(env, *args):
    r = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}...: {r.stderr.strip()[-2000:]}")
    return r.stdout


def journal(state):
    out = subprocess.run([CLI, "log", state, "--json"], capture_output=True, text=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def counting(state, branch="main", at_least=3):
    return sum(1 for e in journal(state) if e["type"] == "proc.message" and e["branch"] == branch) >= at_least


def cold_pair(env, i):
    """Two fresh containers of the agent under tini, started side by side, until both accept."""
    ports = [free_port(), free_port()]
    names = [f"cold-{i}-{k}-{os.urandom(3).hex()}" for k in range(2)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(env, "docker", "run", "-d", "--name", n, "--network", "host",
                                                   "--entrypoint", "/usr/bin/tini", TAG, "--", "python3", "-c",
                                                   LISTENER.format(port=p)))
               for n, p in zip(names, ports)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while not all(accepts(p) for p in ports):
        if time.perf_counter() - t0 > 60:
            raise RuntimeError("cold start: the agents did not listen in 60 s")
        time.sleep(0.002)
    took = time.perf_counter() - t0
    run(env, "docker", "rm", "-f", *names)
    return took


def data_root(env):
    return run(env, "docker", "info", "--format", "{{.DockerRootDir}}").strip()


def docker_checkpoint_fork(env, i, heap_mb):
    """Docker's own: checkpoint A (left running), restore it into two new containers. Returns
    (checkpoint seconds, fork seconds, checkpoint bytes)."""
    common = ["--network", "none", "--entrypoint", "/usr/bin/tini", "-v", f"{AGENT}:/opt/e2e:ro", TAG, "--",
              "python3", "/opt/e2e/counter_agent.py", str(heap_mb)]
    a = f"dck-{heap_mb}-{i}-a"
    run(env, "docker", "run", "-d", "--name", a, *common)
    deadline = time.monotonic() + 30
    while run(env, "docker", "logs", a).count("\n") < 3:
        if time.monotonic() > deadline:
            raise RuntimeError("docker checkpoint peer: the agent did not start counting")
        time.sleep(0.05)
    root = data_root(env)
    t0 = time.perf_counter()
    run(env, "docker", "checkpoint", "create", "--leave-running", a, "cp1")
    t1 = time.perf_counter()
    src = os.path.join(root, "containers", run(env, "docker", "inspect", "-f", "{{.Id}}", a).strip(), "checkpoints", "cp1")
    copies = [f"dck-{heap_mb}-{i}-{k}" for k in range(2)]
    errors = []

    def restore(c):
        try:
            cid = run(env, "docker", "create", "--name", c, *common).strip()
            dst = os.path.join(root, "containers", cid, "checkpoints", "cp1")
            subprocess.run(["cp", "-a", src, dst], check=True)
            # dockerd uploads the checkpoint to containerd's content store by digest, and a second
            # upload of the same bytes fails ("already exists"): one extra file makes each copy's own.
            with open(os.path.join(dst, "bench-copy"), "w") as f:
                f.write(c)
            run(env, "docker", "start", "--checkpoint", "cp1", c)
        except Exception as e:  # noqa: BLE001 (reported below, after both threads end)
            errors.append(e)
    threads = [threading.Thread(target=restore, args=(c,)) for c in copies]  # side by side, as ours
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    t2 = time.perf_counter()
    size = int(subprocess.run(["du", "-sb", src], capture_output=True, text=True, check=True).stdout.split()[0])
    for c in copies:  # both copies run on from A's counter with A's nonce
        last = run(env, "docker", "logs", c).strip().splitlines()
        if not last or json.loads(last[-1])["n"] < 3:
            raise RuntimeError(f"docker checkpoint peer: copy {c} does not count on: {last[-1:]}")
    run(env, "docker", "rm", "-f", a, *copies)
    return t1 - t0, t2 - t1, size


def measure(env, heap_mb):
    rows = {"checkpoint": [], "fork": [], "both": [], "cold": [], "bytes": [],
            "d_checkpoint": [], "d_fork": [], "d_both": [], "d_bytes": []}
    for i in range(RUNS):
        url = run(env, CLI, "up", "--host", "docker", "--image", TAG, "-v", f"{AGENT}:/opt/e2e:ro", "--",
                  "python3", "/opt/e2e/counter_agent.py", str(heap_mb)).strip().splitlines()[-1]
        boxes = [json.loads(line) for line in run(env, CLI, "ps", "--json").splitlines()]
        state = next(b["state_dir"] for b in boxes if b["url"] == url)
        deadline = time.monotonic() + 60
        while not counting(state):
            if time.monotonic() > deadline:
                raise RuntimeError("the agent in A did not start counting")
            time.sleep(0.05)
        t0 = time.perf_counter()
        snap = run(env, CLI, "checkpoint", url).strip().splitlines()[-1]
        t1 = time.perf_counter()
        copies = [line.split()[1] for line in run(env, CLI, "fork", url, "--snapshot", snap, "-n", "2",
                                                  "--host", "docker").splitlines()]
        t2 = time.perf_counter()
        rows["checkpoint"].append(t1 - t0)
        rows["fork"].append(t2 - t1)
        rows["both"].append(t2 - t0)
        created = [e for e in journal(state) if e["type"] == "checkpoint.created" and e["snapshot"] == snap]
        rows["bytes"].append(created[0]["sizes"]["compressed"])
        for u in [url, *copies]:
            run(env, "docker", "rm", "-f", *[b["name"] for b in (json.loads(x) for x in
                                              run(env, CLI, "ps", "--json").splitlines()) if b["url"] == u])
        rows["cold"].append(cold_pair(env, i))
        dc, df, db = docker_checkpoint_fork(env, i, heap_mb)
        rows["d_checkpoint"].append(dc)
        rows["d_fork"].append(df)
        rows["d_both"].append(dc + df)
        rows["d_bytes"].append(db)
    med = {k: statistics.median(v) for k, v in rows.items()}
    agent = f"counter agent + {heap_mb} MB heap" if heap_mb else "counter agent (~10 MB RSS)"
    print(f"checkpoint and fork across containers, {agent}, medians of {RUNS} runs (image {TAG}, private "
          f"dockerd; peer: Docker's own checkpoint, experimental, same criu)")
    print(f"{'what':<46}{'sandboxer':>12}{'peer':>12}{'ratio':>8}")

    def line(what, ours, theirs, unit="ms", scale=1000):
        print(f"{what:<46}{ours * scale:>9.0f} {unit:<3}{theirs * scale:>8.0f} {unit:<3}{ours / theirs:>7.2f}")
    line("checkpoint in A", med["checkpoint"], med["d_checkpoint"])
    line("fork into 2 new containers, live", med["fork"], med["d_fork"])
    line("checkpoint + fork into 2, live", med["both"], med["d_both"])
    line("  same, against 2 cold docker runs (tini)", med["both"], med["cold"])
    line("checkpoint size (ours compressed)", med["bytes"], med["d_bytes"], "KiB", 1 / 1024)
    print()
    rows_file = os.environ.get("SANDBOXER_BENCH_ROWS")
    if rows_file:
        tag = f", {heap_mb} MB heap" if heap_mb else ""

        def row(what, unit, ours, peer=None, peer_value=None):
            return {"bench": "docker_fork", "what": what + tag, "unit": unit, "ours": round(ours, 1), "peer": peer,
                    "peer_value": None if peer_value is None else round(peer_value, 1), "better": "lower"}
        docker_cp = "docker checkpoint (experimental, same criu)"
        docker_fork = "docker create + start --checkpoint, 2 side by side"
        with open(rows_file, "a") as f:
            for r in (row("checkpoint in a container (CLI)", "ms", med["checkpoint"] * 1000, docker_cp,
                          med["d_checkpoint"] * 1000),
                      row("fork into 2 new containers, live (CLI)", "ms", med["fork"] * 1000, docker_fork,
                          med["d_fork"] * 1000),
                      row("checkpoint + fork into 2 containers, live", "ms", med["both"] * 1000,
                          "docker checkpoint + 2 restores", med["d_both"] * 1000),
                      row("checkpoint + fork into 2 containers, vs cold", "ms", med["both"] * 1000,
                          "2 cold docker runs, tini (memory lost)", med["cold"] * 1000),
                      row("checkpoint size (ours zstd)", "KiB", med["bytes"] / 1024,
                          "docker checkpoint dir", med["d_bytes"] / 1024)):
                f.write(json.dumps(r) + "\n")


REMOTE = os.environ.get("BENCH_REMOTE", "1") != "0"


@contextlib.contextmanager
def other_dockerd(env, work):
    """A dockerd in a network namespace of its own, with TAG loaded: the CLI's env for it."""
    name, veth = f"sbx-bench-{os.getpid()}", f"sbxb{os.getpid() % 100000}"
    octet = os.getpid() % 250 + 1
    here, there = f"10.214.{octet}.1", f"10.214.{octet}.2"
    d = os.path.join(work, "remote-d")
    subprocess.run(["ip", "netns", "add", name], check=True)
    renv = None
    try:
        for args in (["-n", name, "link", "set", "lo", "up"],
                     ["link", "add", veth, "type", "veth", "peer", "name", "eth-remote", "netns", name],
                     ["addr", "add", f"{here}/30", "dev", veth], ["link", "set", veth, "up"],
                     ["-n", name, "addr", "add", f"{there}/30", "dev", "eth-remote"],
                     ["-n", name, "link", "set", "eth-remote", "up"]):
            subprocess.run(["ip", *args], check=True)
        out = subprocess.run([os.path.join(ROOT, "scripts", "dockerd"), "start", d], capture_output=True, text=True,
                             check=True, env=dict(os.environ, DOCKERD_NETNS=f"/run/netns/{name}",
                                                  DOCKERD_TCP=f"{there}:2375"))
        local = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
        save = subprocess.Popen(["docker", "save", TAG], env=env, stdout=subprocess.PIPE)
        subprocess.run(["docker", "-H", local, "load"], stdin=save.stdout, capture_output=True, check=True)
        save.stdout.close()
        save.wait()
        renv = dict(env, DOCKER_HOST=f"tcp://{there}:2375")
        yield renv
    finally:
        if renv:
            ids = run(renv, "docker", "ps", "-aq").split()
            if ids:
                run(renv, "docker", "rm", "-f", *ids)
        subprocess.run([os.path.join(ROOT, "scripts", "dockerd"), "stop", d], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def inline_agent(heap_mb):
    with open(os.path.join(AGENT, "counter_agent.py")) as f:
        return ["python3", "-c", f.read(), str(heap_mb)]


def up_counting(env, heap_mb):
    url = run(env, CLI, "up", "--host", "docker", "--image", TAG, "--", *inline_agent(heap_mb)).strip().splitlines()[-1]
    state = next(json.loads(x)["state_dir"] for x in run(env, CLI, "ps", "--json").splitlines()
                 if json.loads(x)["url"] == url)
    deadline = time.monotonic() + 60
    while not counting(state):
        if time.monotonic() > deadline:
            raise RuntimeError("the agent in A did not start counting")
        time.sleep(0.05)
    return url


def measure_remote(env, renv, heap_mb):
    """Fork and migrate from A on the first dockerd onto the other, beside the same on the first."""
    rows = {"local": [], "remote": [], "migrate_local": [], "migrate_remote": []}
    for _ in range(RUNS):
        for key, target in (("local", env), ("remote", renv)):
            url = up_counting(env, heap_mb)
            t0 = time.perf_counter()
            snap = run(env, CLI, "checkpoint", url).strip().splitlines()[-1]
            run(target, CLI, "fork", url, "--snapshot", snap, "-n", "2", "--host", "docker")
            rows[key].append(time.perf_counter() - t0)
            run(env, CLI, "down", url)
            url = up_counting(env, heap_mb)
            t0 = time.perf_counter()
            run(target, CLI, "migrate", url, "--to", "docker")
            rows["migrate_" + key].append(time.perf_counter() - t0)
            with contextlib.suppress(RuntimeError):
                run(env, CLI, "down", url)  # migrate removed it where it was this dockerd's
        for e in (env, renv):
            ids = run(e, "docker", "ps", "-aq").split()
            if ids:
                run(e, "docker", "rm", "-f", *ids)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"onto another dockerd (a network namespace of its own, tcp://), counter agent + {heap_mb} MB heap, "
          f"medians of {RUNS} runs")
    print(f"{'what':<46}{'other':>12}{'same':>12}{'ratio':>8}")
    for what, a, b in (("checkpoint + fork into 2 containers", med["remote"], med["local"]),
                       ("migrate (held, moved, restored, A ended)", med["migrate_remote"], med["migrate_local"])):
        print(f"{what:<46}{a * 1000:>9.0f} ms {b * 1000:>8.0f} ms {a / b:>7.2f}")
    print()
    rows_file = os.environ.get("SANDBOXER_BENCH_ROWS")
    if rows_file:
        with open(rows_file, "a") as f:
            for what, a, b in (("checkpoint + fork into 2 containers on another dockerd", med["remote"], med["local"]),
                               ("migrate onto another dockerd", med["migrate_remote"], med["migrate_local"])):
                f.write(json.dumps({"bench": "docker_fork", "what": f"{what}, {heap_mb} MB heap", "unit": "ms",
                                    "ours": round(a * 1000, 1), "peer": "the same onto the first dockerd",
                                    "peer_value": round(b * 1000, 1), "better": "lower"}) + "\n")


def main():
    if os.geteuid() != 0:
        print("docker_fork: skipped (needs root for dockerd)")
        return
    with _common.private_dockerd("bench-docker-fork.", experimental=True) as (work, env):
        env["XDG_STATE_HOME"] = os.path.join(work, "state")
        run(env, os.path.join(ROOT, "images", "docker-image"), "--build", BUILD, "--tag", TAG)
        for heap_mb in HEAPS:
            measure(env, heap_mb)
        if REMOTE:
            with other_dockerd(env, work) as renv:
                renv["XDG_STATE_HOME"] = env["XDG_STATE_HOME"]
                measure_remote(env, renv, max(HEAPS))


if __name__ == "__main__":
    sys.exit(main())
