#!/usr/bin/env python3
"""Kubernetes manifests for sandboxer boxes, checked against the `kubernetes` client's schemas.

    python shims/kubernetes/generate.py up   [--kind pod|agent-sandbox] [options] [--dry-run] -- CMD...
    python shims/kubernetes/generate.py fork --snapshot S -n N [--from URL] [--kind pod|agent-sandbox] [options] [--dry-run]
    python shims/kubernetes/generate.py migrate --from URL [--kind pod|agent-sandbox] [options] [--dry-run]

Prints the manifests as YAML documents for `kubectl apply -f -` (or `--json` for a v1 List):
- a Secret per box with its WebSocket token, mounted as a file (sandboxer-init --token-file);
  the token comes from --token-file, or is made here and kept where the CLI finds it;
- a PersistentVolumeClaim for checkpoint archives, shared by every box (ReadWriteMany, so forks
  on other nodes read the same archives), mounted at ARCHIVE_DIR;
- with --persist, a PersistentVolumeClaim per box for its state dir (journal, snapshots), so a Pod
  deleted or evicted and created again from the same manifests resumes its agent from the newest
  snapshot: the profile's `checkpoint` section is set (`every` from --checkpoint-every, `on_stop`,
  which the Pod's termination grace covers) and the Pod restarts its container on failure;
- a Pod running sandboxer-init, with the capabilities live checkpoint needs (docs/architecture.md:
  SYS_ADMIN, SYS_PTRACE, NET_ADMIN, SYS_TIME, seccomp and AppArmor unconfined, a tmpfs at /run)
  unless --no-live-checkpoint, and a Service for its WebSocket; or, with --kind agent-sandbox, a
  kubernetes-sigs agent-sandbox `Sandbox` around the same pod spec (its controller makes the
  Service).
`fork --from URL` makes N such boxes idle (`sandboxer-init --idle`), and `migrate --from URL` one;
once they are Ready, the CLI moves the snapshot into them over the box API (issue 17): the
command to run is printed on stderr (`sandboxer fork URL --snapshot S --to ws://BOX.NS.svc:7777
...`, or `sandboxer migrate URL --to ...`), from where the Services resolve (a Pod in the cluster),
each new box's token kept where that CLI finds it by URL. No shared claim is needed then.
`fork` without --from makes N boxes that each restore the one archive ARCHIVE_DIR/S from the
shared claim.

Every manifest is checked before it is printed (validate.py); `--dry-run` prints the same
manifests with the Secret's data redacted and writes nothing.
"""
from __future__ import annotations

import argparse
import base64
import json
import pathlib
import re
import secrets
import shlex
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from shims import common  # noqa: E402
from shims.common import (ARCHIVE_DIR, LIVE_CHECKPOINT_CAPS, PORT, STATE_DIR, TOKEN_DIR,  # noqa: E402
                          TOKEN_FILE, ShimError)
from shims.kubernetes.validate import check_manifest  # noqa: E402

LABEL_APP = "app.kubernetes.io/name"
LABEL_BOX = "sandboxer.dev/box"
LABEL_SNAPSHOT = "sandboxer.dev/snapshot"
LABEL_INDEX = "sandboxer.dev/index"


def _meta(name: str, opts, labels: dict) -> dict:
    return {"name": name, "namespace": opts.namespace, "labels": {LABEL_APP: "sandboxer", **labels}}


def secret(box: str, token: str, opts) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(f"{box}-token", opts, {LABEL_BOX: box}),
            "type": "Opaque", "data": {"token": base64.b64encode(token.encode()).decode()}}


def archive_claim(opts) -> dict:
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": opts.archive_size}}}
    if opts.storage_class:
        spec["storageClassName"] = opts.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(opts.archive_claim, opts, {}), "spec": spec}


def state_claim(box: str, opts) -> dict:
    """The box's state dir on a volume that outlives its Pod (--persist)."""
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": opts.state_size}}}
    if opts.storage_class:
        spec["storageClassName"] = opts.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(f"{box}-state", opts, {LABEL_BOX: box}), "spec": spec}


def pod_spec(box: str, argv: list[str], opts) -> dict:
    container = {
        "name": "box",
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        # The image's ENTRYPOINT is sandboxer-init; `command` names it again so the argv in the
        # manifest is the whole argv.
        "command": argv,
        "workingDir": "/workspace",
        "ports": [{"name": "ws", "containerPort": PORT, "protocol": "TCP"}],
        # Ready once the WebSocket accepts. No liveness probe: a failing one would restart the
        # box and end the agent, and `sandboxer-init --health` is not there yet.
        "readinessProbe": {"tcpSocket": {"port": "ws"}, "periodSeconds": 2},
        "volumeMounts": [
            {"name": "state", "mountPath": STATE_DIR},
            {"name": "run", "mountPath": "/run"},
            {"name": "archives", "mountPath": ARCHIVE_DIR},
            {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
        ],
    }
    # A box the snapshot reaches over the box API (--from) mounts no shared archive claim.
    shared_claim = not getattr(opts, "source", None)
    if not shared_claim:
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "archives"]
    if opts.live_checkpoint:
        container["securityContext"] = {
            "capabilities": {"add": list(LIVE_CHECKPOINT_CAPS)},
            # The runtime's default seccomp profile breaks criu's dump (docs/architecture.md).
            "seccompProfile": {"type": "Unconfined"},
            "appArmorProfile": {"type": "Unconfined"},
        }
    else:
        container["securityContext"] = {"allowPrivilegeEscalation": False}
    limits = {}
    if opts.cpu:
        limits["cpu"] = opts.cpu
    if opts.memory:
        limits["memory"] = opts.memory
    if limits:
        container["resources"] = {"limits": limits, "requests": dict(limits)}
    persist = getattr(opts, "persist", False)
    return {
        # A persisted box that crashes comes back in the same Pod and resumes its agent.
        "restartPolicy": "OnFailure" if persist else "Never",
        # The agent has no business with the cluster's API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Above the supervisor's grace, so the journal is complete when the Pod stops.
        "terminationGracePeriodSeconds": opts.grace + common.STOP_MARGIN_S,
        "containers": [container],
        "volumes": [
            # The supervisor's state (and the branches' writable layers) off the overlay root.
            {"name": "state", **({"persistentVolumeClaim": {"claimName": f"{box}-state"}} if persist
                                 else {"emptyDir": {}})},
            {"name": "run", "emptyDir": {"medium": "Memory"}},
            *([{"name": "archives", "persistentVolumeClaim": {"claimName": opts.archive_claim}}]
              if shared_claim else []),
            {"name": "token", "secret": {"secretName": f"{box}-token", "defaultMode": 0o400}},
        ],
    }


def box_manifests(box: str, argv: list[str], labels: dict, token: str, opts) -> list[dict]:
    labels = {LABEL_BOX: box, **labels}
    spec = pod_spec(box, argv, opts)
    docs = [secret(box, token, opts)]
    if getattr(opts, "persist", False):
        docs.append(state_claim(box, opts))
    if opts.kind == "agent-sandbox":
        from k8s_agent_sandbox import constants as c
        docs.append({
            "apiVersion": f"{c.SANDBOX_API_GROUP}/{c.SANDBOX_API_VERSION}", "kind": "Sandbox",
            "metadata": _meta(box, opts, labels),
            "spec": {"podTemplate": {"metadata": {"labels": {LABEL_APP: "sandboxer", **labels}},
                                     "spec": spec},
                     "service": True},
        })
        return docs
    docs.append({"apiVersion": "v1", "kind": "Pod", "metadata": _meta(box, opts, labels), "spec": spec})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(box, opts, labels),
                 "spec": {"type": "ClusterIP", "selector": {LABEL_BOX: box},
                          "ports": [{"name": "ws", "port": PORT, "targetPort": "ws", "protocol": "TCP"}]}})
    return docs


def _token(opts) -> str:
    """The box token: from --token-file (never from the command line), or a new one."""
    return common.read_token_file(opts.token_file) if opts.token_file else common.new_token()


def service_url(box: str, opts) -> str:
    """The URL the CLI reaches a box by: its Service inside the cluster (or a port-forward of it)."""
    return f"ws://{box}.{opts.namespace}.svc:{PORT}"


def then_argv(opts, boxes: list[tuple[str, str]]) -> list[str] | None:
    """What moves the snapshot into the idle boxes once they are Ready (fork or migrate --from)."""
    source = getattr(opts, "source", None)
    if not source:
        return None
    urls = [service_url(box, opts) for box, _ in boxes]
    if opts.op == "migrate":
        return common.api_migrate_argv(source, urls[0], opts.source_token_file)
    return common.api_fork_argv(source, opts.snapshot, urls, opts.source_token_file)


def generate(opts) -> tuple[list[dict], list[tuple[str, str]]]:
    """The manifests, and (box, token) for each box."""
    source = getattr(opts, "source", None)
    if source:
        common.check_source_url(source)
    # Over the box API the new boxes need no shared claim.
    docs = [] if source else [archive_claim(opts)]
    boxes = []
    if opts.persist and opts.op != "up":
        raise ShimError("--persist: only for up (each copy of a fork starts from its archive)")
    if opts.persist and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(ms|s|m|h|d)?", opts.checkpoint_every):
        raise ShimError(f"--checkpoint-every {opts.checkpoint_every!r}: not a duration (like 30s, 5m, 1h)")
    if opts.op == "up":
        box = opts.name or f"sandboxer-{secrets.token_hex(4)}"
        common.check_name("name", box)
        token = _token(opts)
        sets = [f"checkpoint.every={opts.checkpoint_every}", "checkpoint.on_stop=true"] if opts.persist else []
        argv = common.init_argv(command=opts.command, token_file=TOKEN_FILE, profile=opts.profile, sets=sets)
        docs += box_manifests(box, argv, {}, token, opts)
        boxes.append((box, token))
    elif opts.op == "migrate":
        box = opts.name or f"sandboxer-{secrets.token_hex(4)}"
        common.check_name("name", box)
        token = _token(opts)
        argv = common.init_argv(token_file=TOKEN_FILE, profile=opts.profile)  # idle
        docs += box_manifests(box, argv, {}, token, opts)
        boxes.append((box, token))
    else:
        common.check_name("snapshot", opts.snapshot)
        prefix = opts.name or f"sandboxer-{secrets.token_hex(4)}"
        for i in range(opts.n):
            box = f"{prefix}-{i}"
            common.check_name("name", box)
            token = _token(opts)
            # Idle when the snapshot comes over the API; else restored from the shared claim.
            argv = common.init_argv(restore=None if source else opts.snapshot, token_file=TOKEN_FILE,
                                    profile=opts.profile)
            docs += box_manifests(box, argv, {LABEL_SNAPSHOT: opts.snapshot, LABEL_INDEX: str(i)}, token, opts)
            boxes.append((box, token))
    for d in docs:
        check_manifest(d)
    return docs, boxes


def _box_options(sp) -> None:
    sp.add_argument("--kind", choices=["pod", "agent-sandbox"], default="pod")
    sp.add_argument("--namespace", default="default")
    sp.add_argument("--name", help="box name (fork: the prefix of each copy's name)")
    sp.add_argument("--no-live-checkpoint", dest="live_checkpoint", action="store_false",
                    help="no added capabilities; checkpoints fall back to filesystem snapshots")
    sp.add_argument("--grace", type=int, default=common.DEFAULT_GRACE_S, help="seconds")
    sp.add_argument("--cpu")
    sp.add_argument("--memory")
    sp.add_argument("--archive-claim", default="sandboxer-archives")
    sp.add_argument("--archive-size", default="20Gi")
    sp.add_argument("--storage-class")
    sp.add_argument("--token-file", help="read the box token from this file")
    sp.add_argument("--persist", action="store_true",
                    help="up: the state dir on a claim of its own that outlives the Pod; the agent is resumed")
    sp.add_argument("--state-size", default="10Gi", help="with --persist: the state claim's size")
    sp.add_argument("--checkpoint-every", default="5m", help="with --persist: the period of live checkpoints")
    sp.add_argument("--json", action="store_true", help="a v1 List as JSON instead of YAML")


def _parser() -> argparse.ArgumentParser:
    bp = common.box_parser("generate.py", __doc__.split("\n\n")[0], _box_options,
                           dry_run_help="redact the Secret, write nothing")
    mg = bp.ops.add_parser("migrate", help="start one idle box to move a live agent into")
    mg.add_argument("--image", default=common.DEFAULT_IMAGE)
    mg.add_argument("--profile")
    mg.add_argument("--dry-run", action="store_true", help="redact the Secret, write nothing")
    _box_options(mg)
    for sp, required in ((bp.fork, False), (mg, True)):
        sp.add_argument("--from", dest="source", required=required,
                        help="the URL of the box whose snapshot (fork) or agent (migrate) moves over the box API")
        sp.add_argument("--from-token-file", dest="source_token_file", help="that box's token")
    return bp.parser


def _redact(docs: list[dict]) -> list[dict]:
    out = []
    for d in docs:
        if d["kind"] == "Secret":
            d = {**d, "data": {k: common.REDACTED for k in d["data"]}}
        out.append(d)
    return out


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    try:
        common.check_box_args(opts, max_copies=256, text_host="Kubernetes")
        docs, boxes = generate(opts)
    except ShimError as e:
        print(f"sandboxer kubernetes: {e}", file=sys.stderr)
        return 2
    if opts.dry_run:
        docs = _redact(docs)
    else:
        for box, token in boxes:
            # The URL the CLI reaches a box by is its Service inside the cluster (or a
            # port-forward of it): the token is kept under that name.
            path = common.save_token(service_url(box, opts), token)
            print(f"# {box}: token kept in {path}", file=sys.stderr)
    if then := then_argv(opts, boxes):
        sel = f"{LABEL_BOX} in ({','.join(b for b, _ in boxes)})"
        print(f"# then, once kubectl wait --for=condition=Ready -n {opts.namespace} pod -l '{sel}' returns:\n"
              f"#   {shlex.join(then)}", file=sys.stderr)
    if opts.json:
        json.dump({"apiVersion": "v1", "kind": "List", "items": docs}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        import yaml
        sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
