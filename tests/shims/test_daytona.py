"""shims/daytona: its dry-run bodies against daytona-api-client's own model classes."""
import copy

import daytona_api_client as d
import pytest
from shimrun import run_plan, run_shim, no_network, shim_env  # noqa: F401 (fixtures)

from shims.common import ShimError
from shims.daytona.shim import validate_body

UP = ["-m", "shims.daytona", "up", "--dry-run", "--", "python3", "/workspace/agent.py"]


@pytest.fixture(scope="module")
def up_plan(shim_env):
    return run_plan(UP, shim_env)


def request(plan, call):
    (r,) = [r for r in plan["requests"] if r["call"] == call]
    return copy.deepcopy(r)


def test_up_dry_run_prints_bodies_the_client_models_accept(up_plan):
    assert up_plan["sdk"] == f"daytona-api-client {d.__version__}"
    assert [(r["method"], r["call"]) for r in up_plan["requests"]] == [
        ("POST", "VolumesApi.create_volume"), ("POST", "SnapshotsApi.create_snapshot"),
        ("POST", "SecretApi.create_secret"), ("POST", "SandboxApi.create_sandbox"),
        ("GET", "SandboxApi.get_port_preview_url")]
    for r in up_plan["requests"]:
        if "model" in r:
            validate_body(getattr(d, r["model"]), r["body"])  # checked again here


def test_snapshot_reads_the_command_from_each_sandboxs_variable_and_does_not_bake_it_in(shim_env, up_plan):
    body = request(up_plan, "SnapshotsApi.create_snapshot")["body"]
    assert body["imageName"] == "sandboxer/agent:0.1.0"
    assert body["entrypoint"][:3] == ["sandboxer-init", "--listen", "0.0.0.0:7777"]
    assert body["entrypoint"][-2:] == ["--command-env", "SANDBOXER_ARGV"]
    assert "python3" not in body["entrypoint"]
    # Another command: the same snapshot (its name follows what it holds), another variable.
    other = run_plan(["-m", "shims.daytona", "up", "--dry-run", "--", "sh", "-c", "echo 'a b'"], shim_env)
    assert request(other, "SnapshotsApi.create_snapshot")["body"] == body
    assert request(other, "SandboxApi.create_sandbox")["body"]["env"] == {"SANDBOXER_ARGV": '["sh", "-c", "echo \'a b\'"]'}


def test_sandbox_gets_token_secret_archive_volume_and_preview_url(up_plan):
    secret = request(up_plan, "SecretApi.create_secret")
    assert secret["body"]["value"] == "<redacted>"
    sandbox = request(up_plan, "SandboxApi.create_sandbox")["body"]
    assert sandbox["secrets"] == [{"SANDBOXER_TOKEN": secret["body"]["name"]}]
    assert sandbox["volumes"] == [{"volumeId": "sandboxer-archives",
                                   "mountPath": "/var/lib/sandboxer/archives"}]
    assert sandbox["public"] is False
    assert sandbox["env"] == {"SANDBOXER_ARGV": '["python3", "/workspace/agent.py"]'}
    preview = request(up_plan, "SandboxApi.get_port_preview_url")
    assert preview["url"].endswith(f"/sandbox/{sandbox['name']}/ports/7777/preview-url")


@pytest.mark.parametrize("change, message", [
    # A plausible mistake: Daytona sandboxes take no command of their own.
    (lambda b: b.update(entrypoint=["sandboxer-init"]), "unknown field"),
    (lambda b: b.update(snapshotName=b.pop("snapshot")), "snapshotName"),
    (lambda b: b["volumes"][0].update(readOnly=True), "readOnly"),
    (lambda b: b.update(cpu="2"), "cpu"),
    (lambda b: b.update(public="false"), "public"),
    (lambda b: b["volumes"][0].pop("mountPath"), "mount_path"),
])
def test_wrong_sandbox_body_is_rejected(up_plan, change, message):
    body = request(up_plan, "SandboxApi.create_sandbox")["body"]
    validate_body(d.CreateSandbox, body)  # control: the shim's body passes
    change(body)
    with pytest.raises(ShimError, match=message):
        validate_body(d.CreateSandbox, body)


def test_wrong_snapshot_body_is_rejected(up_plan):
    body = request(up_plan, "SnapshotsApi.create_snapshot")["body"]
    validate_body(d.CreateSnapshot, body)
    body["entrypoint"] = " ".join(body["entrypoint"])
    with pytest.raises(ShimError, match="entrypoint"):
        validate_body(d.CreateSnapshot, body)
    body = request(up_plan, "SnapshotsApi.create_snapshot")["body"]
    body["sandboxClass"] = "microvm"
    with pytest.raises(ShimError, match="sandbox_class|sandboxClass"):
        validate_body(d.CreateSnapshot, body)


def test_linux_vm_class_and_dockerfile_build(shim_env, tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM debian:trixie-slim\nCOPY --from=debian:trixie /etc/os-release /tmp/\n")
    plan = run_plan(["-m", "shims.daytona", "up", "--class", "linux-vm", "--dockerfile",
                     str(dockerfile), "--dry-run", "--", "true"], shim_env)
    body = request(plan, "SnapshotsApi.create_snapshot")["body"]
    assert body["sandboxClass"] == "linux-vm"
    assert body["buildInfo"] == {"dockerfileContent": dockerfile.read_text()}
    assert "imageName" not in body


def test_fork_makes_one_restoring_snapshot_and_n_sandboxes(shim_env):
    plan = run_plan(["-m", "shims.daytona", "fork", "--snapshot", "s1", "-n", "3", "--dry-run"], shim_env)
    snap = request(plan, "SnapshotsApi.create_snapshot")["body"]
    i = snap["entrypoint"].index("--restore")
    assert snap["entrypoint"][i + 1] == "/var/lib/sandboxer/archives/s1"
    boxes = [r["body"] for r in plan["requests"] if r["call"] == "SandboxApi.create_sandbox"]
    assert len(boxes) == 3
    assert {b["snapshot"] for b in boxes} == {snap["name"]}
    assert sorted(b["labels"]["sandboxer.index"] for b in boxes) == ["0", "1", "2"]
    assert len({b["secrets"][0]["SANDBOXER_TOKEN"] for b in boxes}) == 3
    for b in boxes:
        validate_body(d.CreateSandbox, b)


def test_bad_input_is_refused_with_its_reason(shim_env):
    p = run_shim(["-m", "shims.daytona", "fork", "--snapshot", "s1", "-n", "65", "--dry-run"],
                 shim_env, check=False)
    assert p.returncode == 2
    assert "-n 65" in p.stderr
    p = run_shim(["-m", "shims.daytona", "up", "--dockerfile", "/nonexistent/Dockerfile",
                  "--dry-run", "--", "true"], shim_env, check=False)
    assert p.returncode == 2
    assert "/nonexistent/Dockerfile" in p.stderr
    # Daytona's API carries the command as text: a word that is not UTF-8 (the byte 0xe9) would
    # become another one there.
    p = run_shim(["-m", "shims.daytona", "up", "--dry-run", "--", "ls", "caf\udce9"], shim_env, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert "command word 1 b'caf\\xe9' is not UTF-8: a box's command reaches Daytona as text" in p.stderr


def test_dockerfile_that_copies_local_files_is_refused(shim_env):
    # images/Dockerfile copies the bundle and images/ from its build context, which a Daytona
    # build from the Dockerfile's text alone would not have.
    p = run_shim(["-m", "shims.daytona", "up", "--dockerfile", "images/Dockerfile", "--dry-run",
                  "--", "true"], shim_env, check=False)
    assert p.returncode == 2
    assert "copies files from the build context" in p.stderr and "--image" in p.stderr


def test_what_the_live_path_also_uses_is_in_the_client():
    # Beyond the printed requests, the live path polls the snapshot and the sandbox until they
    # are ready and compares their states: those calls and state names are the client's.
    import inspect
    inspect.signature(d.SnapshotsApi.get_snapshot).bind(None, "sandboxer-agent-0.1.0")
    inspect.signature(d.SandboxApi.get_sandbox).bind(None, "sandboxer-box")
    for state in ("active", "build_failed", "error"):
        d.SnapshotState(state)
    for state in ("started", "error", "build_failed", "destroyed"):
        d.SandboxState(state)
    assert {"url", "token"} <= set(d.PortPreviewUrl.model_fields)


def test_snapshot_name_follows_what_it_holds(shim_env, up_plan):
    # An existing snapshot is reused on a 409, so its name must change with its entrypoint.
    name = request(up_plan, "SnapshotsApi.create_snapshot")["body"]["name"]
    again = run_plan(UP, shim_env)
    assert request(again, "SnapshotsApi.create_snapshot")["body"]["name"] == name
    other = run_plan(["-m", "shims.daytona", "up", "--profile", "strict", "--dry-run", "--", "true"], shim_env)
    body = request(other, "SnapshotsApi.create_snapshot")["body"]
    assert body["name"] != name and "--profile" in body["entrypoint"]


def test_fork_from_a_box_starts_idle_sandboxes_without_a_volume(shim_env, up_plan):
    src = "ws://10.0.0.5:7000"
    plan = run_plan(["-m", "shims.daytona", "fork", "--snapshot", "s-0123456789abcdef", "-n", "2", "--from", src,
                     "--public", "--dry-run"], shim_env)
    snap = request(plan, "SnapshotsApi.create_snapshot")["body"]
    # The image `up` uses, its sandboxer-init waiting idle (a snapshot of its own, made once: its
    # name says what it holds), not reading a command.
    up_snap = request(up_plan, "SnapshotsApi.create_snapshot")["body"]
    assert snap["imageName"] == up_snap["imageName"] and snap["name"] != up_snap["name"]
    assert snap["entrypoint"] == [*up_snap["entrypoint"][:-2], "--idle"]
    boxes = [r["body"] for r in plan["requests"] if r["call"] == "SandboxApi.create_sandbox"]
    assert len(boxes) == 2 and all("volumes" not in b and "env" not in b and b["public"] for b in boxes)
    assert not [r for r in plan["requests"] if r["call"] == "VolumesApi.create_volume"]
    for b in boxes:
        validate_body(d.CreateSandbox, b)
    names = [b["name"] for b in boxes]
    assert plan["then"] == ["sandboxer", "fork", src, "--snapshot", "s-0123456789abcdef",
                            "--to", f"<wss preview URL of {names[0]}>", "--to", f"<wss preview URL of {names[1]}>"]


def test_fork_from_needs_public_previews(shim_env):
    p = run_shim(["-m", "shims.daytona", "fork", "--snapshot", "s1", "-n", "1", "--from", "ws://a:1", "--dry-run"],
                 shim_env, check=False)
    assert p.returncode == 2 and "needs --public" in p.stderr and p.stdout == ""
