#!/usr/bin/env python3
"""The first agent a newcomer runs: a tiny agent loop with no model and no network.

It plans, writes a script that computes the first 50 primes, runs it, checks the answer against
an independent check, fixes its script once if the check fails, and reports. Each step is one
JSON line on stdout (the supervisor turns those into `proc.message` events); the script's own
output and the tool runs show up as plain output.

With --stay it waits after its report until it is stopped (`sandboxer down`), so that README's
walk-through has a live agent to exec into, copy from, checkpoint and fork."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

WORKSPACE = pathlib.Path(os.environ.get("SANDBOXER_WORKSPACE", os.getcwd()))
COUNT = int(os.environ.get("PRIMES_COUNT", "50"))

# The first draft has a classic bug (it counts 1 as prime); the agent finds it by checking.
DRAFTS = [
    """import sys
n = int(sys.argv[1])
found, k = [], 1
while len(found) < n:
    if all(k % d for d in range(2, int(k ** 0.5) + 1)):
        found.append(k)
    k += 1
print(" ".join(map(str, found)))
""",
    """import sys
n = int(sys.argv[1])
found, k = [], 2
while len(found) < n:
    if all(k % d for d in range(2, int(k ** 0.5) + 1)):
        found.append(k)
    k += 1
print(" ".join(map(str, found)))
""",
]


def step(kind, **fields):
    print(json.dumps({"step": kind, **fields}), flush=True)


def is_prime(k):
    return k >= 2 and all(k % d for d in range(2, k))


def check(numbers):
    """An independent check: every number prime, ascending, none skipped."""
    if len(numbers) != COUNT:
        return f"expected {COUNT} numbers, got {len(numbers)}"
    for i, k in enumerate(numbers):
        if not is_prime(k):
            return f"{k} (position {i + 1}) is not prime"
    for a, b in zip(numbers, numbers[1:]):
        if any(is_prime(k) for k in range(a + 1, b)):
            return f"a prime between {a} and {b} is missing"
    return None


def main():
    step("plan", goal=f"compute the first {COUNT} primes", workspace=str(WORKSPACE))
    script = WORKSPACE / "primes.py"
    for attempt, draft in enumerate(DRAFTS, start=1):
        script.write_text(draft)
        step("write", path=str(script), bytes=len(draft), attempt=attempt)
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, str(script), str(COUNT)], capture_output=True, text=True, timeout=60)
        step("run", exit_code=run.returncode, seconds=round(time.monotonic() - t0, 3))
        if run.returncode != 0:
            step("error", stderr=run.stderr[-500:])
            continue
        print(run.stdout, end="", flush=True)
        numbers = [int(x) for x in run.stdout.split()]
        problem = check(numbers)
        step("check", ok=problem is None, problem=problem)
        if problem is None:
            step("report", primes=numbers, last=numbers[-1], attempts=attempt)
            return 0
    step("report", primes=None, error="no draft passed the check")
    return 1


if __name__ == "__main__":
    code = main()
    if "--stay" in sys.argv[1:]:
        step("stay", note="waiting until stopped")
        # TERM (`sandboxer down`, its grace period) ends it with the report's status.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
        while True:
            signal.pause()
    sys.exit(code)
