"""shims/modal: its dry run against the installed `modal` package's own signatures."""
import copy

import modal
import pytest
from shimrun import run_plan, run_shim, no_network, shim_env  # noqa: F401 (fixtures)

from shims.common import ShimError
from shims.sdkcheck import call_from_json, check_call

UP = ["-m", "shims.modal", "up", "--dry-run", "--", "python3", "/workspace/agent.py"]


@pytest.fixture(scope="module")
def up_plan(shim_env):
    return run_plan(UP, shim_env)


def calls(plan, name):
    return [c for c in plan["calls"] if c["call"] == name]


def check_all(plan):
    for c in plan["calls"]:
        check_call(modal, call_from_json(c))


def test_up_dry_run_prints_calls_the_sdk_accepts(up_plan):
    plan = copy.deepcopy(up_plan)
    assert plan["sdk"] == f"modal {modal.__version__}"
    assert [c["call"] for c in plan["calls"]] == [
        "App.lookup", "Image.from_registry", "Image.entrypoint", "Volume.from_name",
        "Secret.from_dict", "Sandbox.create", "Sandbox.tunnels"]
    check_all(plan)  # the printed calls, checked again here against the SDK


def test_up_runs_sandboxer_init_with_the_websocket_on_an_encrypted_port(up_plan):
    plan = copy.deepcopy(up_plan)
    (create,) = calls(plan, "Sandbox.create")
    assert create["args"][:3] == ["sandboxer-init", "--listen", "0.0.0.0:7777"]
    assert create["args"][-3:] == ["--", "python3", "/workspace/agent.py"]
    assert create["kwargs"]["encrypted_ports"] == [7777]
    assert create["kwargs"]["volumes"] == {"/var/lib/sandboxer/archives": {"$ref": "volume#4"}}
    # The image's own ENTRYPOINT is cleared so the Sandbox's command is the whole argv.
    assert calls(plan, "Image.entrypoint")[0]["args"] == [[]]


def test_token_travels_only_as_a_secret(up_plan):
    plan = copy.deepcopy(up_plan)
    (secret,) = calls(plan, "Secret.from_dict")
    assert secret["args"] == [{"SANDBOXER_TOKEN": "<redacted>"}]
    (create,) = calls(plan, "Sandbox.create")
    assert create["kwargs"]["secrets"] == [{"$ref": secret["returns"]}]
    assert not any("token" in a for a in create["args"])
    assert "env" not in create["kwargs"]


def test_dockerfile_build_uses_from_dockerfile(shim_env):
    plan = run_plan(["-m", "shims.modal", "up", "--dockerfile", "images/Dockerfile", "--dry-run",
                     "--", "true"], shim_env)
    (build,) = calls(plan, "Image.from_dockerfile")
    assert build["args"] == ["images/Dockerfile"]
    check_all(plan)


def test_wrong_argument_name_is_rejected(up_plan):
    plan = copy.deepcopy(up_plan)
    (create,) = [call_from_json(c) for c in calls(plan, "Sandbox.create")]
    check_call(modal, create)  # control: the shim's own call binds
    wrong = copy.deepcopy(create)
    wrong.kwargs["encrypted_port"] = wrong.kwargs.pop("encrypted_ports")
    with pytest.raises(ShimError, match="encrypted_port"):
        check_call(modal, wrong)


def test_wrong_argument_type_is_rejected(up_plan):
    plan = copy.deepcopy(up_plan)
    (create,) = [call_from_json(c) for c in calls(plan, "Sandbox.create")]
    wrong = copy.deepcopy(create)
    wrong.kwargs["encrypted_ports"] = ["7777"]
    with pytest.raises(ShimError, match="encrypted_ports"):
        check_call(modal, wrong)
    wrong = copy.deepcopy(create)
    wrong.kwargs["runtime"] = "kata"  # not one of the SDK's Literal['gvisor', 'vm']
    with pytest.raises(ShimError, match="runtime"):
        check_call(modal, wrong)
    # A handle of the wrong class: a Secret where the SDK takes an Image.
    wrong = copy.deepcopy(create)
    wrong.kwargs["image"] = wrong.kwargs["secrets"][0]
    with pytest.raises(ShimError, match="image"):
        check_call(modal, wrong)


def test_unknown_sdk_function_is_rejected(up_plan):
    plan = copy.deepcopy(up_plan)
    (vol,) = [call_from_json(c) for c in calls(plan, "Volume.from_name")]
    vol.path = "Volume.lookup_or_create"
    with pytest.raises(ShimError, match="no such attribute"):
        check_call(modal, vol)


def test_fork_via_volume_restores_one_archive_in_each_sandbox(shim_env):
    plan = run_plan(["-m", "shims.modal", "fork", "--snapshot", "s1", "-n", "3", "--dry-run"], shim_env)
    creates = calls(plan, "Sandbox.create")
    assert len(creates) == 3
    for c in creates:
        i = c["args"].index("--restore")
        assert c["args"][i + 1] == "/var/lib/sandboxer/archives/s1"
        assert "--" not in c["args"]
    # Each copy has a token of its own.
    assert len({c["kwargs"]["secrets"][0]["$ref"] for c in creates}) == 3
    assert len(calls(plan, "Sandbox.tunnels")) == 3
    check_all(plan)


def test_fork_via_modal_snapshot_cold_restarts_the_command(shim_env):
    plan = run_plan(["-m", "shims.modal", "fork", "--snapshot", "s1", "-n", "2", "--via",
                     "modal-snapshot", "--sandbox-id", "sb-abc", "--dry-run", "--", "python3", "a.py"],
                    shim_env)
    (snap,) = calls(plan, "Sandbox.snapshot_filesystem")
    assert snap["on"] == {"$ref": calls(plan, "Sandbox.from_id")[0]["returns"]}
    for c in calls(plan, "Sandbox.create"):
        assert c["kwargs"]["image"] == {"$ref": snap["returns"]}
        assert c["kwargs"]["env"] == {"SANDBOXER_RESUMED": "1", "SANDBOXER_SNAPSHOT": "s1"}
        assert c["args"][-3:] == ["--", "python3", "a.py"]
        # The parent's journal came along in the snapshot; the copy writes a journal of its own.
        assert c["args"][c["args"].index("--state-dir") + 1] == "/var/lib/sandboxer/fork"
    check_all(plan)


@pytest.mark.parametrize("argv, message", [
    (["up", "--dry-run"], "give the agent's command"),
    (["fork", "--snapshot", "s1", "-n", "0", "--dry-run"], "-n 0"),
    (["fork", "--snapshot", "../x", "-n", "1", "--dry-run"], "snapshot '../x'"),
    (["fork", "--snapshot", "s1", "-n", "1", "--via", "modal-snapshot", "--dry-run"], "--sandbox-id"),
    # Bytes that are not UTF-8 (the \udce9 is the byte 0xe9 on the shim's command line): Modal's
    # API takes text, where the word would become another (U+FFFD).
    (["up", "--dry-run", "--", "ls", "/tmp/caf\udce9"], "command word 1 b'/tmp/caf\\xe9' is not UTF-8"),
    (["fork", "--snapshot", "s1", "-n", "1", "--via", "modal-snapshot", "--sandbox-id", "sb-1", "--dry-run",
      "--", "a\udcff"], "command word 0 b'a\\xff' is not UTF-8: a box's command reaches Modal as text"),
])
def test_bad_input_is_refused_with_its_reason(shim_env, argv, message):
    p = run_shim(["-m", "shims.modal", *argv], shim_env, check=False)
    assert p.returncode == 2
    assert message in p.stderr
    assert p.stdout == ""
    assert p.stdout == ""


def test_in_process_checks_run_without_network():
    import socket
    with pytest.raises(OSError, match="no network in shim tests"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)


def test_what_the_live_path_also_uses_is_in_the_sdk():
    # The live path reads the tunnel's URL, the Sandbox's id, and catches the SDK's base error.
    from modal._tunnel import Tunnel
    assert "url" in dir(Tunnel)
    assert "object_id" in dir(modal.Sandbox)
    assert issubclass(modal.exception.NotFoundError, modal.exception.Error)


def test_fork_from_a_box_starts_idle_sandboxes_and_hands_the_move_to_the_cli(shim_env):
    src = "wss://src.example.invalid:443"
    plan = run_plan(["-m", "shims.modal", "fork", "--snapshot", "s-0123456789abcdef", "-n", "2", "--from", src,
                     "--dry-run"], shim_env)
    creates = calls(plan, "Sandbox.create")
    assert len(creates) == 2
    for c in creates:
        # Idle, no archive to restore, no Volume: the snapshot comes over the box API.
        assert c["args"][-1] == "--idle" and "--restore" not in c["args"]
        assert "volumes" not in c["kwargs"]
    assert not calls(plan, "Volume.from_name")
    assert len({c["kwargs"]["secrets"][0]["$ref"] for c in creates}) == 2
    tunnels = [c["returns"] for c in calls(plan, "Sandbox.tunnels")]
    # Then the CLI streams the snapshot from the source into each, copy i into the i-th.
    assert plan["then"] == ["sandboxer", "fork", src, "--snapshot", "s-0123456789abcdef",
                            "--to", f"<wss URL of {tunnels[0]}>", "--to", f"<wss URL of {tunnels[1]}>"]
    check_all(plan)


@pytest.mark.parametrize("argv, message", [
    (["--via", "volume", "--from", "ws://a:1"], "--from URL goes with --via api"),
    (["--via", "api"], "--from URL goes with --via api"),
    (["--from", "http://a:1"], "the source box's ws:// or wss:// URL"),
    (["--from", "ws://a:1", "--", "python3", "a.py"], "the command comes from the snapshot"),
])
def test_fork_from_refuses_what_it_cannot_do(shim_env, argv, message):
    p = run_shim(["-m", "shims.modal", "fork", "--snapshot", "s1", "-n", "1", "--dry-run", *argv], shim_env,
                 check=False)
    assert p.returncode == 2 and message in p.stderr and p.stdout == "", p.stderr
