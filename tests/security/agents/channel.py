"""Attack programs for tests/security/test_channel_scope.py and test_lifecycle.py: the agent (root
in its box, hostile) uses its agent channel. One subcommand per attack; each prints one JSON line
(a proc.message) with what it tried and what the supervisor answered.

    reach SNAPFILE     wait for the operator's snapshot id in SNAPFILE, then restore and delete it
    fork N...          fork N copies for each N in turn (copies exit at once)
    checkpoints N      take N checkpoints, then delete the first and take one more
    copy_policy        fork 1; the cold copy reports its workspace and Landlock, as the original does
    sleeper            fork 1 (unless this is a copy); every process then waits, reporting USR1
    dump               ask for a checkpoint; report the answer
    name NAME          take a checkpoint named NAME (terminal escapes and all), send an event
                       whose type holds NAME; report, then wait
"""
import json
import os
import pathlib
import signal
import sys
import time

# The agent starts with a clean environment: the SDK is found beside this file, in the host's
# tree the box sees read-only.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "sdk" / "python" / "sandboxer"))
import agent  # noqa: E402  (sdk/python/sandboxer/agent.py)


def say(**kv):
    print(json.dumps(kv), flush=True)


def attempt(fn, *a, **kw):
    try:
        r = fn(*a, **kw)
        return {"ok": True, "reply": r}
    except agent.ChannelError as e:
        return {"ok": False, "code": e.code, "message": e.message}


def resumed():
    return os.environ.get("SANDBOXER_RESUMED") == "1"


def reach(path):
    ch = agent.Channel()
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = open(path).read().strip()
    out = {"snapshot": snap, "listed": [s["id"] for s in ch.snapshots()]}
    out["restore"] = attempt(ch.restore, snap)
    out["delete"] = attempt(ch.delete_snapshot, snap)
    # Control: its own snapshot is within reach.
    own = ch.checkpoint("own")["snapshot"]
    out["own_listed"] = [s["id"] for s in ch.snapshots()]
    out["own_delete"] = attempt(ch.delete_snapshot, own)
    say(**out)
    # The box lives on while the operator's control runs: until it says so.
    while not os.path.exists(path + ".end") and time.monotonic() < deadline + 30:
        time.sleep(0.05)


def fork(counts):
    ch = agent.Channel()
    for n in counts:
        r = attempt(ch.fork, n)
        if r["ok"] and r["reply"].get("copy"):
            return  # a live copy (criu): nothing more to do
        say(n=n, **r)


def checkpoints(n):
    ch = agent.Channel()
    taken = []
    for i in range(n):
        r = attempt(ch.checkpoint, f"c{i}")
        say(i=i, **r)
        if r["ok"]:
            taken.append(r["reply"]["snapshot"])
    ch.delete_snapshot(taken[0])
    say(after_delete=True, **attempt(ch.checkpoint, "again"))


def copy_policy():
    st = os.statvfs("/workspace")
    try:
        os.close(os.open("/dev/full", os.O_WRONLY))
        landlock = "writable"
    except OSError as e:
        landlock = f"refused: {e.strerror}"
    me = {"uid": os.getuid(), "workspace_uid": os.stat("/workspace").st_uid,
          "workspace_bytes": st.f_blocks * st.f_frsize, "dev_full": landlock,
          "file": open("/workspace/seed").read() if os.path.exists("/workspace/seed") else None}
    if resumed():
        say(copy=True, branch=os.environ.get("SANDBOXER_BRANCH"), **me)
        return
    with open("/workspace/seed", "w") as f:
        f.write("from the original")
    say(original=True, **me)
    say(fork=attempt(agent.Channel().fork, 1))


def sleeper():
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(1) or say(usr1=os.environ.get("SANDBOXER_BRANCH")))
    if not resumed():
        say(fork=attempt(agent.Channel().fork, 1))
    say(ready=os.environ.get("SANDBOXER_BRANCH"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)


def dump():
    say(pid=os.getpid(), asking=True)
    say(checkpoint=attempt(agent.Channel().checkpoint, "x"))
    say(still_running=True)
    time.sleep(1)


def name(text):
    say(named=attempt(agent.Channel().checkpoint, text))
    agent.Channel().event("t" + text, detail=text)  # an event type of its choosing too
    deadline = time.monotonic() + 60
    while not os.path.exists("/workspace/done") and time.monotonic() < deadline:
        time.sleep(0.05)


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "reach":
        if resumed():
            return
        reach(args[0])
    elif cmd == "fork":
        if resumed():
            return
        fork([int(a) for a in args])
    elif cmd == "checkpoints":
        checkpoints(int(args[0]))
    elif cmd == "copy_policy":
        copy_policy()
    elif cmd == "sleeper":
        sleeper()
    elif cmd == "dump":
        dump()
    elif cmd == "name":
        name(args[0])
    else:
        raise SystemExit(f"unknown attack {cmd}")


if __name__ == "__main__":
    main()
