"""What the tests share besides fixtures: the built binaries and the journal reader.

A module of its own rather than conftest.py: tests/sdk_python has a conftest.py too, and two
modules both named `conftest` cannot both be imported by that name in one pytest run."""
import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = pathlib.Path(os.environ.get("SANDBOXER_BUILD", ROOT / "build"))
BIN = BUILD / "bin"
INIT = BIN / "sandboxer-init"
CLI = BIN / "sandboxer"
PROBE = BIN / "sbx-testprobe"


def read_journal(state_dir, since=0):
    """Every event of a box's journal, through `sandboxer log --json` (the reader users have)."""
    out = subprocess.run([str(CLI), "log", str(state_dir), "--json", "--since", str(since)],
                         check=True, capture_output=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def run_init(args, state_dir, *, as_pid1=True, timeout=60, **kw):
    """Runs sandboxer-init (as PID 1 of a fresh pid namespace unless as_pid1=False)."""
    cmd = [str(INIT), "--state-dir", str(state_dir)] + list(args)
    if as_pid1:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc"] + cmd
    return subprocess.run(cmd, timeout=timeout, capture_output=True, **kw)
