"""The CLI's snapshot commands over the WebSocket: checkpoint a live agent, list, fork."""
import json
import subprocess
import time

from conftest import CLI
from wsbox import WsBox

# A counter that keeps its state in memory only: a copy that continues from the checkpoint
# prints numbers after the one it was at, which a cold restart cannot do.
COUNTER = ("import time, sys\n"
           "n = 0\n"
           "while True:\n"
           "    n += 1\n"
           "    print(n, flush=True)\n"
           "    time.sleep(0.1)\n")


def cli(box, *args, timeout=120):
    return subprocess.run([str(CLI), *args, "--token-file", str(box.token_file)], capture_output=True, text=True,
                          timeout=timeout)


def outputs(box, branch):
    for line in box.events.read_text().splitlines():
        e = json.loads(line)
        if e["type"] == "proc.output" and e.get("branch") == branch:
            yield from (int(x) for x in e.get("data", "").split())


def test_checkpoint_then_fork_two_live_copies(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(1.0)
        r = cli(box, "checkpoint", box.url, "--name", "cli")
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip().splitlines()[-1]
        assert snap.startswith("s-"), r.stdout
        listed = cli(box, "snapshots", box.url)
        assert listed.returncode == 0 and snap in listed.stdout
        at_checkpoint = max(outputs(box, "main"))
        f = cli(box, "fork", box.url, "--snapshot", snap, "-n", "2")
        assert f.returncode == 0, f.stderr
        branches = [line.split()[0] for line in f.stdout.splitlines()]
        assert len(branches) == 2 and len(set(branches)) == 2 and "main" not in branches
        time.sleep(1.5)
        for b in branches:
            seen = list(outputs(box, b))
            assert seen, f"copy {b} printed nothing"
            # It continues from memory: its first number follows the checkpoint's count closely.
            assert seen[0] > 1 and seen[0] <= at_checkpoint + 2, (b, seen[:3], at_checkpoint)
        # A refused request is a clear error and a non-zero exit.
        bad = cli(box, "fork", box.url, "--snapshot", "s-0000000000000000", "-n", "1")
        assert bad.returncode != 0 and "sandboxer fork:" in bad.stderr
