"""Attack programs of tests/security/test_files.py, run as the agent (root in its box).

usage: files.py tmp-swap VICTIM_DIR        plant /tmp/x -> VICTIM_DIR, fork; the copy makes x a
                                           world-writable directory with ld.so.preload in it and
                                           checkpoints itself (issue #13 item 4)
       files.py run-plant VICTIM1 VICTIM2  plant symlinks at /run/sandboxer/branch.json's
                                           temporary (VICTIM1) and at its place (VICTIM2), fork;
                                           the copy says what its branch.json is (item 5)

Each prints JSON lines; a copy's line says `copy: true`."""
import json
import os
import sys

# The agent starts with a clean environment: the SDK is found beside this file, in the host's
# tree the box sees read-only.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "sdk", "python",
                                "sandboxer"))
import agent as channel_module  # noqa: E402  (sdk/python/sandboxer/agent.py, stdlib only)


def say(**kw):
    print(json.dumps(kw), flush=True)


def checkpoint_self(ch, name):
    try:
        r = ch.checkpoint(name)
        return {"ok": True, "snapshot": r.get("snapshot")}
    except channel_module.ChannelError as e:
        return {"ok": False, "code": e.code, "message": e.message}


def fork_once(ch):
    """True in the copy (live: the fork returns there; cold: the command starts again)."""
    if os.environ.get("SANDBOXER_RESUMED") == "1":
        return True
    r = ch.fork(1)
    if not r.get("copy"):
        say(original=True, snapshot=r.get("snapshot"), copies=r.get("copies"))
        return False
    return True


def tmp_swap(victim):
    ch = channel_module.Channel()
    if os.environ.get("SANDBOXER_RESUMED") != "1":
        os.symlink(victim, "/tmp/x")
    if not fork_once(ch):
        return
    # The copy: x, a symlink to the host's directory in the snapshot, is now a directory of ours.
    os.unlink("/tmp/x")
    os.mkdir("/tmp/x")
    os.chmod("/tmp/x", 0o777)
    with open("/tmp/x/ld.so.preload", "w") as f:
        f.write("/workspace/evil.so\n")
    say(copy=True, checkpoint=checkpoint_self(ch, "swapped"))


def run_plant(victim1, victim2):
    ch = channel_module.Channel()
    if os.environ.get("SANDBOXER_RESUMED") != "1":
        # The supervisor is PID 1 of its pid namespace in these tests: its old temporary for
        # branch.json was branch.json.tmp.1.
        os.symlink(victim1, "/run/sandboxer/branch.json.tmp.1")
        os.unlink("/run/sandboxer/branch.json")
        os.symlink(victim2, "/run/sandboxer/branch.json")
    if not fork_once(ch):
        return
    st = os.lstat("/run/sandboxer/branch.json")
    try:
        info = channel_module.branch_info()
    except (OSError, ValueError) as e:
        info = str(e)
    say(copy=True, regular=bool(st.st_mode & 0o100000) and not os.path.islink("/run/sandboxer/branch.json"),
        branch_json=info)


if __name__ == "__main__":
    {"tmp-swap": tmp_swap, "run-plant": run_plant}[sys.argv[1]](*sys.argv[2:])
