"""The host shims' fork over the box API (issue 17), from where the host has started the boxes:
what shims/common.py and the Modal shim do once a host reports N idle boxes and their URLs. The
boxes here are real sandboxer-init processes on loopback and the move is the real CLI; only the
host that started them (Modal's SDK, which cannot be reached from here) is stood in for, by
handles that record what the shim asks of it."""
import os
import subprocess
import socket
import sys
import time
from types import SimpleNamespace

import pytest

from sbxtest import CLI, INIT, ROOT, WsBox, clean_env, output, read_events
from test_cli_send import COUNTER, checkpoint, numbers, wait_numbers

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shims import common  # noqa: E402
from shims.common import ShimError  # noqa: E402
from shims.modal import shim as modal_shim  # noqa: E402


@pytest.fixture
def cli_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "cli-state"))
    monkeypatch.setenv("SANDBOXER_CLI", str(CLI))
    monkeypatch.delenv("SANDBOXER_TOKEN", raising=False)


def boxes(tmp_path, n):
    (tmp_path / "a").mkdir()
    a = WsBox(tmp_path / "a", ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"])
    idle = []
    for i in range(n):
        (tmp_path / f"t{i}").mkdir()
        idle.append(WsBox(tmp_path / f"t{i}", [], extra=["--idle", "--set", "resources.grace=1s"]))
    return a, idle


class HostStandIn:
    """What the Modal shim's live path calls on its SDK after the Sandboxes exist: terminate."""

    def __init__(self):
        self.terminated = []

    def method(self, obj, path, *args, **kwargs):
        assert path == "Sandbox.terminate"
        self.terminated.append(obj.object_id)


def sandboxes(idle):
    return [(SimpleNamespace(object_id=f"sb-{i}"), None) for i, _ in enumerate(idle)]


def test_wait_serving_waits_refuses_a_bad_token_at_once_and_gives_up_with_the_reason(tmp_path, cli_state):
    a, (t,) = boxes(tmp_path, 1)
    with a, t:
        common.wait_serving(t.url, t.token_file.read_text().strip(), timeout=10)
        # A refused token is not "not yet": the 401's message at once, not the timeout's.
        with pytest.raises(ShimError, match="refused the token"):
            common.wait_serving(t.url, "wrong-token", timeout=60)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"ws://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ShimError, match=r"not serving after 2 s"):
        common.wait_serving(dead, "x", timeout=2)


def test_the_modal_shims_fork_over_the_api_makes_each_idle_box_a_copy(tmp_path, cli_state, capsys):
    a, idle = boxes(tmp_path, 2)
    with a, idle[0], idle[1]:
        snap = checkpoint(a)
        at_checkpoint = max(numbers(a))
        opts = SimpleNamespace(source=a.url, snapshot=snap, source_token_file=str(a.token_file))
        tokens = [t.token_file.read_text().strip() for t in idle]
        host = HostStandIn()
        assert modal_shim._fork_over_api(host, opts, sandboxes(idle), [t.url for t in idle], tokens) == 0
        assert host.terminated == []
        assert capsys.readouterr().out.splitlines() == [f"sb-{i} {t.url}" for i, t in enumerate(idle)]
        for i, t in enumerate(idle):
            seen = wait_numbers(t)
            assert seen and 1 < seen[0] <= at_checkpoint + 2, (i, seen[:3])
            done = next(e for e in t.read_events() if e["type"] == "restore.done")
            assert (done["index"], done["from"]) == (i, a.url), done
            # The shim kept each box's token where the CLI finds it by URL.
            assert os.path.exists(common.token_path(t.url))


def test_a_failed_move_terminates_every_sandbox_the_shim_started(tmp_path, cli_state):
    a, idle = boxes(tmp_path, 2)
    with a, idle[0], idle[1]:
        opts = SimpleNamespace(source=a.url, snapshot="s-0000000000000000", source_token_file=str(a.token_file))
        tokens = [t.token_file.read_text().strip() for t in idle]
        host = HostStandIn()
        with pytest.raises(ShimError, match="sandboxer fork exited 1"):
            modal_shim._fork_over_api(host, opts, sandboxes(idle), [t.url for t in idle], tokens)
        assert host.terminated == ["sb-0", "sb-1"]
        assert all(t.alive() and not numbers(t) for t in idle) and a.alive()



def test_the_daytona_shims_sandbox_runs_its_command_from_the_variable_its_plan_sets(tmp_path):
    # What `up` asks Daytona for, run here by the real supervisor: the snapshot's entrypoint with
    # the sandbox's variables. One snapshot serves every command; each sandbox holds its own.
    from shims.daytona import shim as daytona_shim
    opts = daytona_shim._parser().parse_args(["up", "--", "/bin/sh", "-c", 'echo "$1"; env', "sh", "a b 'c' café"])
    reqs = daytona_shim.plan_up(daytona_shim._client(daytona_shim.DEFAULT_API, "k"), opts, "b1", "t")
    (snap,) = [r.body for r in reqs if r.api == "SnapshotsApi.create_snapshot"]
    (sandbox,) = [r.body for r in reqs if r.api == "SandboxApi.create_sandbox"]
    entry = snap["entrypoint"]
    assert entry[0] == "sandboxer-init" and entry[-2] == "--command-env"
    i = entry.index("--listen")
    argv = [str(INIT), *entry[1:i], *entry[i + 2:]]  # no listener: nothing to serve here
    argv[argv.index("--state-dir") + 1] = str(tmp_path / "state")
    events = tmp_path / "events.jsonl"
    env = {**clean_env(), **sandbox["env"]}
    p = subprocess.run([*argv, "--events", str(events), "--env-inherit"], env=env, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = output(read_events(events))
    assert out.startswith("a b 'c' café\n"), out
    # The variable is the supervisor's: the agent, inheriting the whole environment, has not got it.
    assert "SANDBOXER_ARGV" not in out and "PATH=" in out
    # The same snapshot without the variable (a sandbox made by hand) says what is missing.
    p = subprocess.run([*argv, "--events", str(tmp_path / "e2")], env=clean_env(), capture_output=True, timeout=60)
    assert p.returncode == 125 and b"--command-env SANDBOXER_ARGV: SANDBOXER_ARGV is not set" in p.stderr
