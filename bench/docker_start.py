#!/usr/bin/env python3
"""Docker start-up: `docker run` of the runtime image until sandboxer-init's WebSocket API
accepts, beside `docker run` of the same image with tini as its entrypoint, in one run,
interleaved so that machine noise hits both alike. Also the image's build time (warm cache) and
size. A private dockerd (scripts/dockerd) runs for the measurement and is stopped after.

Rows (medians of BENCH_RUNS runs, default 8):
- to agent listening: `docker run -d` until the agent (a Python TCP listener) accepts, under
  sandboxer-init (default profile: its own pid + mount namespaces, criu's caps) and under tini;
- to API accepting: `docker run -d` until sandboxer-init answers a WebSocket upgrade (tini has
  no API: its column is the agent-listening time, the moment its box is usable at all);
- run to exit: `docker run --rm IMAGE -- true` as a whole, each entrypoint.

Also writes rows for bench/run (bench/_rows.py). Not a test: nothing asserts. Needs root (dockerd)."""
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import _common
import _rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("SANDBOXER_BUILD", os.path.join(ROOT, "build"))
RUNS = int(os.environ.get("BENCH_RUNS", "2" if _rows.QUICK else "8"))
TAG = "sandboxer/agent:bench"
CAPS = ["--cap-add", "SYS_ADMIN", "--cap-add", "SYS_PTRACE", "--cap-add", "NET_ADMIN", "--cap-add", "SYS_TIME",
        "--security-opt", "seccomp=unconfined", "--tmpfs", "/run"]
LISTENER = "import socket,time\ns=socket.socket()\ns.bind(('127.0.0.1',{port}))\ns.listen()\ntime.sleep(600)\n"


free_port = _common.free_port


def answers(port, upgrade):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            if not upgrade:
                return True
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      b"Sec-WebSocket-Key: YmVuY2hiZW5jaGJlbmNoMQ==\r\nSec-WebSocket-Version: 13\r\n"
                      b"Sec-WebSocket-Protocol: sandboxer.v1\r\n\r\n")
            return s.recv(64).startswith((b"HTTP/1.1 101", b"HTTP/1.1 401"))
    except OSError:
        return False


def docker(env, *args, check=True):
    return subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=120, check=check)


def time_until(env, run_args, port, upgrade, name):
    t0 = time.perf_counter()
    docker(env, "run", "-d", "--name", name, "--network", "host", *run_args)
    while not answers(port, upgrade):
        if time.perf_counter() - t0 > 60:
            raise RuntimeError(f"{name}: nothing on port {port} after 60 s")
        time.sleep(0.002)
    took = time.perf_counter() - t0
    docker(env, "rm", "-f", name)
    return took


def main():
    if os.geteuid() != 0:
        print("docker_start: skipped (needs root for dockerd)")
        _rows.emit("docker_start", "(the whole benchmark)", "", None, note="not run: needs root for a private dockerd")
        return
    try:
        run()
    except subprocess.CalledProcessError as e:
        why = ((e.stderr or "") if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")).strip()
        why = why.splitlines()[-1] if why else f"exit {e.returncode}"
        print(f"docker_start: {' '.join(map(str, e.cmd))[:120]} failed: {why}", file=sys.stderr)
        _rows.emit("docker_start", "(the whole benchmark)", "", None,
                   note=f"{os.path.basename(str(e.cmd[0]))} {' '.join(map(str, e.cmd[1:3]))} failed: {why}")
        return 1


def run():
    with _common.private_dockerd("bench-docker.") as (work, env):
        t0 = time.perf_counter()
        subprocess.run([os.path.join(ROOT, "images", "docker-image"), "--build", BUILD, "--tag", TAG],
                       env=env, capture_output=True, check=True)
        build_s = time.perf_counter() - t0
        size = json.loads(docker(env, "image", "inspect", TAG).stdout)[0]["Size"]
        token = os.path.join(work, "token")
        with open(token, "w") as f:
            f.write(os.urandom(16).hex())
        os.chmod(token, 0o600)
        tok = ["-v", f"{token}:/etc/sandboxer/token:ro"]
        rows = {"to agent listening": ([], []), "to API accepting": ([], []), "run to exit (true)": ([], [])}
        for i in range(RUNS):
            p = free_port()
            rows["to agent listening"][0].append(time_until(
                env, [*CAPS, *tok, TAG, "--metrics-interval", "0", "--token-file", "/etc/sandboxer/token",
                      "--", "python3", "-c", LISTENER.format(port=p)], p, False, f"sbx-a{i}"))
            p = free_port()
            rows["to agent listening"][1].append(time_until(
                env, ["--entrypoint", "/usr/bin/tini", TAG, "--", "python3", "-c", LISTENER.format(port=p)],
                p, False, f"tini-a{i}"))
            p = free_port()
            rows["to API accepting"][0].append(time_until(
                env, [*CAPS, *tok, TAG, "--metrics-interval", "0", "--token-file", "/etc/sandboxer/token",
                      "--listen", f"127.0.0.1:{p}", "--", "sleep", "600"], p, True, f"sbx-w{i}"))
            rows["to API accepting"][1].append(rows["to agent listening"][1][-1])
            for col, args in ((0, [*CAPS, TAG, "--metrics-interval", "0", "--", "true"]),
                              (1, ["--entrypoint", "/usr/bin/tini", TAG, "--", "true"])):
                t0 = time.perf_counter()
                docker(env, "run", "--rm", "--network", "none", *args)
                rows["run to exit (true)"][col].append(time.perf_counter() - t0)
        print(f"docker start-up, medians of {RUNS} runs (image {TAG}: {size / 1e6:.0f} MB, "
              f"built in {build_s:.1f} s from images/build's cache)")
        print(f"{'what':<24}{'sandboxer-init':>16}{'tini':>10}{'ratio':>8}")
        described = {
            "to agent listening": "`docker run -d` to the agent listening (Python TCP listener)",
            "to API accepting": "`docker run -d` to the WebSocket API accepting (tini: to the agent listening)",
            "run to exit (true)": "`docker run --rm IMAGE -- true`, whole",
        }
        for what, (ours, theirs) in rows.items():
            a, b = statistics.median(ours), statistics.median(theirs)
            print(f"{what:<24}{a * 1000:>13.0f} ms{b * 1000:>7.0f} ms{a / b:>8.2f}")
            _rows.emit("docker_start", f"{described[what]}, median of {RUNS}", "ms", a * 1000,
                       "docker run with tini", b * 1000)
        _rows.emit("docker_start", "runtime image size (python variant)", "MB", size / 1e6)
        _rows.emit("docker_start", "image rebuild from images/build's cache", "s", build_s)


if __name__ == "__main__":
    sys.exit(main())
