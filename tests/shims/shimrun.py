"""Shared by the shim tests (imported by each, like tests/sbxtest.py, rather than a conftest.py):
run a shim the way a user would, with no network at all.

Each shim runs as a subprocess inside a network namespace of its own (`unshare --net`: only a
loopback that is down), so a dry run that tried to reach Modal, Daytona or a cluster would fail
loudly instead of quietly depending on it. HOME and XDG_STATE_HOME point into the test's tmp
directory, so no user configuration (~/.modal.toml, ~/.kube/config) is read and nothing is kept
outside it. In-process checks run with socket connections refused (no_network below)."""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PY = sys.executable


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(self, *a, **kw):
        raise OSError("tests/shims: no network in shim tests")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(scope="module")
def shim_env(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("shim")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MODAL_", "DAYTONA_", "KUBECONFIG"))}
    env.update(HOME=str(tmp_path / "home"), XDG_STATE_HOME=str(tmp_path / "state"),
               PYTHONDONTWRITEBYTECODE="1")
    (tmp_path / "home").mkdir()
    return env


def run_shim(argv, env, *, check=True, timeout=60):
    """Runs `python ARGV...` from the repository root, without network where we can."""
    cmd = [PY, *argv]
    if os.geteuid() == 0 and shutil.which("unshare"):
        cmd = ["unshare", "--net", *cmd]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} exited {p.returncode}: {p.stderr}")
    return p


def run_plan(argv, env):
    return json.loads(run_shim(argv, env).stdout)
