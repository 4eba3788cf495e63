"""shims/kubernetes: generated manifests against the `kubernetes` client's bundled schemas."""
import base64
import copy
import json
import os
import pathlib

import pytest
import yaml
from shimrun import run_shim, no_network, shim_env  # noqa: F401 (fixtures)

from shims.common import ShimError
from shims.kubernetes.validate import check_manifest

GEN = ["shims/kubernetes/generate.py"]


def generate(env, *argv):
    out = run_shim([*GEN, *argv], env).stdout
    return list(yaml.safe_load_all(out))


@pytest.fixture(scope="module")
def up_docs(shim_env):
    return generate(shim_env, "up", "--name", "box1", "--dry-run", "--", "python3", "/workspace/agent.py")


def kind(docs, k):
    return [copy.deepcopy(d) for d in docs if d["kind"] == k]


def test_up_makes_claim_secret_pod_service_and_the_client_accepts_each(up_docs):
    assert [d["kind"] for d in up_docs] == ["PersistentVolumeClaim", "Secret", "Pod", "Service"]
    for d in up_docs:
        check_manifest(d)  # checked again here


def test_pod_has_the_capabilities_live_checkpoint_needs(up_docs):
    (pod,) = kind(up_docs, "Pod")
    c = pod["spec"]["containers"][0]
    assert sorted(c["securityContext"]["capabilities"]["add"]) == ["NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE", "SYS_TIME"]
    assert c["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert {"name": "run", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 10
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_without_live_checkpoint_no_capability_is_added(shim_env):
    docs = generate(shim_env, "up", "--no-live-checkpoint", "--dry-run", "--", "true")
    (pod,) = kind(docs, "Pod")
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert "capabilities" not in sc and "seccompProfile" not in sc


def test_websocket_service_and_token_file(up_docs):
    (pod,) = kind(up_docs, "Pod")
    (svc,) = kind(up_docs, "Service")
    (sec,) = kind(up_docs, "Secret")
    c = pod["spec"]["containers"][0]
    assert c["command"][:3] == ["sandboxer-init", "--listen", "0.0.0.0:7777"]
    assert c["command"][c["command"].index("--token-file") + 1] == "/etc/sandboxer/secret/token"
    assert {"name": "token", "secret": {"secretName": sec["metadata"]["name"], "defaultMode": 0o400}} in pod["spec"]["volumes"]
    assert svc["spec"]["selector"] == {"sandboxer.dev/box": "box1"}
    assert svc["spec"]["ports"] == [{"name": "ws", "port": 7777, "targetPort": "ws", "protocol": "TCP"}]
    assert sec["data"] == {"token": "<redacted>"}


def test_token_from_file_goes_into_the_secret_and_never_on_a_command_line(shim_env, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-value\n")
    out = run_shim([*GEN, "up", "--name", "box2", "--token-file", str(token_file), "--", "true"], shim_env).stdout
    docs = list(yaml.safe_load_all(out))
    (sec,) = kind(docs, "Secret")
    assert base64.b64decode(sec["data"]["token"]).decode() == "s3cret-token-value"
    (pod,) = kind(docs, "Pod")
    assert "s3cret-token-value" not in json.dumps(pod)
    # Kept where the CLI and sdk/python look a token up by URL: the URL percent-encoded.
    saved = pathlib.Path(shim_env["XDG_STATE_HOME"], "sandboxer", "tokens",
                         "ws%3A%2F%2Fbox2.default.svc%3A7777")
    assert os.stat(saved).st_mode & 0o777 == 0o600
    assert saved.read_text() == "s3cret-token-value\n"


@pytest.mark.parametrize("change, message", [
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(capabilitiez={}), "capabilitiez"),
    (lambda p: p["spec"]["containers"][0]["ports"][0].update(containerPort="7777"), "containerPort"),
    (lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(add="SYS_ADMIN"), "add"),
    (lambda p: p["spec"].update(restartPolicyy="Never"), "restartPolicyy"),
    (lambda p: p.update(specs={}), "specs"),
    (lambda p: p["spec"]["containers"][0].pop("name"), "name"),
])
def test_wrong_pod_is_rejected(up_docs, change, message):
    (pod,) = kind(up_docs, "Pod")
    check_manifest(pod)  # control
    change(pod)
    with pytest.raises(ShimError, match=message):
        check_manifest(pod)


def test_round_trip_refuses_what_the_deserializer_drops():
    from shims.kubernetes.validate import _first_difference
    assert _first_difference({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {}}, "X") == \
        "X.b.c: dropped by the client (not in its schema)"
    assert "came back as" in _first_difference({"a": "1"}, {"a": 1}, "X")


def test_unknown_kind_is_rejected():
    with pytest.raises(ShimError, match="not one these shims make"):
        check_manifest({"apiVersion": "v1", "kind": "Pood", "metadata": {"name": "x"}})


def test_fork_makes_n_pods_restoring_one_archive_from_the_shared_claim(shim_env):
    docs = generate(shim_env, "fork", "--snapshot", "s1", "-n", "3", "--name", "fk", "--dry-run")
    pods = kind(docs, "Pod")
    (claim,) = kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert [p["metadata"]["name"] for p in pods] == ["fk-0", "fk-1", "fk-2"]
    for p in pods:
        cmd = p["spec"]["containers"][0]["command"]
        assert cmd[cmd.index("--restore") + 1] == "/var/lib/sandboxer/archives/s1"
        assert {"name": "archives", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in p["spec"]["volumes"]
    assert len(kind(docs, "Service")) == 3 and len(kind(docs, "Secret")) == 3
    for d in docs:
        check_manifest(d)


def test_agent_sandbox_variant(shim_env):
    from k8s_agent_sandbox import constants as c
    docs = generate(shim_env, "up", "--kind", "agent-sandbox", "--name", "as1", "--dry-run", "--", "true")
    (sb,) = kind(docs, "Sandbox")
    assert sb["apiVersion"] == f"{c.SANDBOX_API_GROUP}/{c.SANDBOX_API_VERSION}"
    assert sb["spec"]["service"] is True
    assert sb["spec"]["podTemplate"]["spec"]["containers"][0]["command"][0] == "sandboxer-init"
    assert not kind(docs, "Pod") and not kind(docs, "Service")
    check_manifest(sb)
    for change, message in [
        (lambda s: s["spec"].update(podTemplat=s["spec"].pop("podTemplate")), "podTemplate"),
        (lambda s: s.update(apiVersion="agents.x-k8s.io/v0"), "apiVersion"),
        (lambda s: s["spec"]["podTemplate"]["spec"]["containers"][0].update(imag="x"), "imag"),
        (lambda s: s["spec"].update(service="yes"), "service"),
    ]:
        bad = copy.deepcopy(sb)
        change(bad)
        with pytest.raises(ShimError, match=message):
            check_manifest(bad)


def test_bad_input_is_refused_with_its_reason(shim_env):
    p = run_shim([*GEN, "fork", "--snapshot", "a/b", "-n", "2"], shim_env, check=False)
    assert p.returncode == 2 and "snapshot 'a/b'" in p.stderr and p.stdout == ""
    p = run_shim([*GEN, "up", "--token-file", "/nonexistent", "--", "true"], shim_env, check=False)
    assert p.returncode == 2 and "/nonexistent" in p.stderr
    # A word that is not UTF-8 (the byte 0xe9): a manifest is text, where it would become another.
    p = run_shim([*GEN, "up", "--", "ls", "caf\udce9"], shim_env, check=False)
    assert p.returncode == 2 and p.stdout == "", p.stdout
    assert "command word 1 b'caf\\xe9' is not UTF-8: a box's command reaches Kubernetes as text" in p.stderr
    docs = list(yaml.safe_load_all(run_shim([*GEN, "up", "--", "ls", "café"], shim_env).stdout))
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert pod["spec"]["containers"][0]["command"][-2:] == ["ls", "café"]


def test_persist_keeps_the_state_dir_on_a_claim_that_outlives_the_pod(shim_env, up_docs):
    docs = generate(shim_env, "up", "--name", "box1", "--persist", "--checkpoint-every", "2m", "--state-size", "5Gi",
                    "--dry-run", "--", "python3", "/workspace/agent.py")
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "Secret", "PersistentVolumeClaim", "Pod", "Service"]
    (pod,) = kind(docs, "Pod")
    (claim,) = [d for d in kind(docs, "PersistentVolumeClaim") if d["metadata"]["name"] == "box1-state"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    state = [v for v in pod["spec"]["volumes"] if v["name"] == "state"]
    assert state == [{"name": "state", "persistentVolumeClaim": {"claimName": "box1-state"}}]
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    argv = pod["spec"]["containers"][0]["command"]
    sets = [argv[i + 1] for i, a in enumerate(argv[:argv.index("--")]) if a == "--set"]
    assert sets == ["checkpoint.every=2m", "checkpoint.on_stop=true"]
    # The control: without --persist the state dir dies with the Pod.
    (plain,) = kind(up_docs, "Pod")
    assert {"name": "state", "emptyDir": {}} in plain["spec"]["volumes"] and plain["spec"]["restartPolicy"] == "Never"
    for d in docs:
        check_manifest(d)


def test_persist_refuses_what_it_cannot_do(shim_env):
    p = run_shim([*GEN, "up", "--persist", "--checkpoint-every", "often", "--", "true"], shim_env, check=False)
    assert p.returncode == 2 and "--checkpoint-every 'often': not a duration" in p.stderr
    p = run_shim([*GEN, "fork", "--persist", "--snapshot", "s", "-n", "2"], shim_env, check=False)
    assert p.returncode == 2 and "--persist: only for up" in p.stderr


def test_fork_from_a_box_makes_idle_pods_and_says_what_moves_the_snapshot_in(shim_env):
    src = "ws://sandboxer-a.default.svc:7777"
    p = run_shim([*GEN, "fork", "--snapshot", "s-0123456789abcdef", "-n", "2", "--name", "cp", "--from", src,
                  "--dry-run"], shim_env)
    docs = list(yaml.safe_load_all(p.stdout))
    assert [d["kind"] for d in docs] == ["Secret", "Pod", "Service"] * 2  # no shared claim
    for pod in kind(docs, "Pod"):
        c = pod["spec"]["containers"][0]
        assert c["command"][-1] == "--idle" and "--restore" not in c["command"]
        assert "archives" not in {v["name"] for v in pod["spec"]["volumes"]}
        assert "archives" not in {m["name"] for m in c["volumeMounts"]}
        # The capabilities criu needs to restore the copy live.
        assert "SYS_ADMIN" in c["securityContext"]["capabilities"]["add"]
    for d in docs:
        check_manifest(d)
    assert ("sandboxer fork ws://sandboxer-a.default.svc:7777 --snapshot s-0123456789abcdef "
            "--to ws://cp-0.default.svc:7777 --to ws://cp-1.default.svc:7777") in p.stderr, p.stderr
    assert "kubectl wait --for=condition=Ready" in p.stderr


def test_migrate_makes_one_idle_pod_and_says_what_moves_the_agent_in(shim_env):
    p = run_shim([*GEN, "migrate", "--name", "mv", "--from", "ws://old.default.svc:7777", "--dry-run"], shim_env)
    docs = list(yaml.safe_load_all(p.stdout))
    (pod,) = kind(docs, "Pod")
    assert pod["spec"]["containers"][0]["command"][-1] == "--idle"
    for d in docs:
        check_manifest(d)
    assert "sandboxer migrate ws://old.default.svc:7777 --to ws://mv.default.svc:7777" in p.stderr, p.stderr
    bad = run_shim([*GEN, "migrate", "--name", "mv", "--dry-run"], shim_env, check=False)
    assert bad.returncode == 2 and "--from" in bad.stderr and bad.stdout == ""
    bad = run_shim([*GEN, "migrate", "--from", "file:///etc/passwd", "--dry-run"], shim_env, check=False)
    assert bad.returncode == 2 and "ws:// or wss:// URL" in bad.stderr and bad.stdout == ""
