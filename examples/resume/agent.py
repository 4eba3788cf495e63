#!/usr/bin/env python3
"""An agent that survives a cold restart: it keeps its session in its workspace and, when
started again with SANDBOXER_RESUMED=1, continues from the last step it finished.

On a host without live checkpoint (Modal's gVisor, a `docker run` without the caps) a checkpoint
keeps only files, and a restore or fork re-runs the agent's command on them with
SANDBOXER_RESUMED=1 and SANDBOXER_SNAPSHOT set (docs/architecture.md, "Hosts"). Memory is gone; whatever the
agent wrote down is not. So this agent writes each finished step to `session.jsonl` (fsynced
before it reports the step) and, resumed, reads it back. No model, no network: each step is a
link of a SHA-256 chain, so the final value shows that no step was skipped or done twice.

Each step is one JSON line on stdout (a `proc.message` event)."""
import hashlib
import json
import os
import pathlib
import time

WORKSPACE = pathlib.Path(os.environ.get("SANDBOXER_WORKSPACE", os.getcwd()))
SESSION = WORKSPACE / "session.jsonl"
STEPS = int(os.environ.get("RESUME_STEPS", "8"))
STEP_SECONDS = float(os.environ.get("RESUME_STEP_SECONDS", "0.5"))
SEED = "sandboxer"


def say(kind, **fields):
    print(json.dumps({"step": kind, **fields}), flush=True)


def link(previous: str, i: int) -> str:
    return hashlib.sha256(f"{previous}:{i}".encode()).hexdigest()


def load_session() -> list[dict]:
    """The finished steps; a torn last line (the box died mid-write) is dropped."""
    done = []
    try:
        lines = SESSION.read_text().splitlines()
    except FileNotFoundError:
        return done
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break
        if entry.get("i") != len(done):
            break
        done.append(entry)
    return done


def record(entry: dict) -> None:
    with open(SESSION, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> int:
    resumed = os.environ.get("SANDBOXER_RESUMED") == "1"
    if resumed:
        done = load_session()
        say("resumed", snapshot=os.environ.get("SANDBOXER_SNAPSHOT"), done=len(done))
        # Rewrite the session without a torn tail, so appends continue a clean file.
        SESSION.write_text("".join(json.dumps(e) + "\n" for e in done))
    else:
        done = []
        SESSION.unlink(missing_ok=True)
        say("start", steps=STEPS)
    value = done[-1]["value"] if done else SEED
    for i in range(len(done), STEPS):
        time.sleep(STEP_SECONDS)
        value = link(value, i)
        record({"i": i, "value": value})
        say("work", i=i, value=value)
    say("report", steps=STEPS, final=value, resumed=resumed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
