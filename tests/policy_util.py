"""Helpers shared by the integration tests of ceilings and policy and by the attack suite
(tests/security/): run a box with profile overrides and read what happened from its journal."""
from sbxtest import PROBE, read_journal, run_init


def box(state_dir, argv, *sets, profile=None, timeout=60, env=None):
    """Runs one box to its end (sandboxer-init as PID 1 of a fresh pid namespace)."""
    args = []
    if profile:
        args += ["--profile", profile]
    for s in sets:
        args += ["--set", s]
    r = run_init(args + ["--"] + [str(a) for a in argv], state_dir, timeout=timeout, env=env)
    return r, read_journal(state_dir)


def probe(*args):
    return [str(PROBE)] + [str(a) for a in args]


def output(events, stream="stdout"):
    return "".join(e.get("data", "") for e in events if e["type"] == "proc.output" and e["stream"] == stream)


def exited(events):
    ex = [e for e in events if e["type"] == "proc.exited"]
    assert len(ex) == 1, ex
    return ex[0]


def of_type(events, t):
    return [e for e in events if e["type"] == t]


def started(events):
    return of_type(events, "box.started")[0]
