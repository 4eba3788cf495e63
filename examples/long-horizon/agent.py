#!/usr/bin/env python3
"""A long-horizon agent to leave running: it works in rounds (reads its notes, does a unit of
work, grows its working set, writes results), reports each round as a JSON line, and then goes
quiet, so that the profile's `idle` or `timeout` ends it with that reason in `proc.exited`.

Environment: ROUNDS (default 20), ROUND_SECONDS (0.5), QUIET_AFTER (1: fall silent after the rounds).
"""
import hashlib
import json
import os
import pathlib
import time

WORKSPACE = pathlib.Path(os.environ.get("SANDBOXER_WORKSPACE", os.getcwd()))
ROUNDS = int(os.environ.get("ROUNDS", "20"))
ROUND_SECONDS = float(os.environ.get("ROUND_SECONDS", "0.5"))


def main():
    notes = WORKSPACE / "notes.jsonl"
    working_set = []
    digest = hashlib.sha256()
    for n in range(1, ROUNDS + 1):
        t0 = time.monotonic()
        # A unit of work that costs CPU, and a working set that grows by 2 MiB a round.
        for i in range(20000):
            digest.update(f"{n}:{i}".encode())
        working_set.append(bytearray(2 * 1024 * 1024))
        with notes.open("a") as f:
            f.write(json.dumps({"round": n, "digest": digest.hexdigest()[:16]}) + "\n")
        print(json.dumps({"step": "round", "round": n, "digest": digest.hexdigest()[:16],
                          "working_set_mib": 2 * len(working_set)}), flush=True)
        time.sleep(max(0.0, ROUND_SECONDS - (time.monotonic() - t0)))
    print(json.dumps({"step": "waiting", "note": "work done; waiting for instructions"}), flush=True)
    if os.environ.get("QUIET_AFTER", "1") == "1":
        while True:  # no output, no CPU: the idle limit ends this
            time.sleep(3600)


if __name__ == "__main__":
    main()
