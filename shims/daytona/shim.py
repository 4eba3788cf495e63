"""The Daytona shim, written against Daytona's OpenAPI client (PyPI `daytona-api-client`, pinned
in shims/requirements.txt).

    python -m shims.daytona up   [--image REF | --dockerfile PATH] [--class container|linux-vm] [--dry-run] -- CMD...
    python -m shims.daytona fork --snapshot S -n N --from URL [--from-token-file F] --public [--dry-run]
    python -m shims.daytona fork --snapshot S -n N [--dry-run]
    python -m shims.daytona down SANDBOX [--dry-run]

`up` makes, in order: a volume for checkpoint archives (mounted at ARCHIVE_DIR), a Daytona
secret holding the box token (mounted as the variable SANDBOXER_TOKEN, which sandboxer-init reads
and removes from its environment), a Daytona snapshot of the image whose entrypoint is
sandboxer-init waiting idle with its WebSocket on PORT, a sandbox from that snapshot, and the
sandbox's preview URL for PORT. Daytona sandboxes take no per-sandbox command, but variables of
their own: the snapshot's entrypoint is `sandboxer-init ... --command-env SANDBOXER_ARGV`, and each
sandbox's SANDBOXER_ARGV holds its agent's command as a JSON array (sandboxer-init removes it from
its environment), so one snapshot serves every command. A command word that is not UTF-8 is
refused: Daytona's API carries text.

Live checkpoint needs CAP_SYS_ADMIN and friends inside the sandbox: a `linux-vm` sandbox (its own
kernel, root inside) can grant them, a `container` one may not. The shim does not guess: the
supervisor says in `box.started` what it could do, and falls back to filesystem snapshots.

`fork --from URL` starts N sandboxes idle from the same Daytona snapshot `up` uses, waits until
each serves, and has the CLI stream snapshot S out of the box at URL into each and restore it as
copy i (`sandboxer fork URL --snapshot S --to ...`): live where the sandbox grants criu what it
needs, cold otherwise (`restore.done` says which); no volume is mounted, and the source may be on
any host. It needs `--public`: the CLI does not send Daytona's preview token. On a failure every
sandbox it started is deleted. Without `--from`, `fork` makes one snapshot whose entrypoint
restores archive S from the volume, and N sandboxes from it. `--dry-run` contacts nothing: every request body is validated by the client's own model
classes with extra keys refused (validate_body), serialised by the client's own request
serialisers, and printed as JSON (method, path, body; the token redacted).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import secrets
import sys
from dataclasses import dataclass
from typing import Any

import pydantic

from .. import common
from ..common import ARCHIVE_DIR, PORT, TOKEN_ENV, ShimError

DEFAULT_API = "https://app.daytona.io/api"
# The variable each sandbox of `up` holds its agent's command in (a JSON array): the snapshot's
# entrypoint, one for every command, reads it with `sandboxer-init --command-env`.
COMMAND_ENV = "SANDBOXER_ARGV"


def _known_keys(model_cls) -> dict[str, str]:
    """Wire name -> field name for a generated model (the OpenAPI schema's property names)."""
    return {(f.serialization_alias or name): name
            for name, f in model_cls.model_fields.items() if name != "additional_properties"}


def _no_extras(obj, path: str) -> None:
    if isinstance(obj, pydantic.BaseModel):
        extra = getattr(obj, "additional_properties", None) or {}
        if extra:
            raise ShimError(f"{path}: unknown field(s) {sorted(extra)} for {type(obj).__name__}")
        for name in type(obj).model_fields:
            if name != "additional_properties":
                _no_extras(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _no_extras(v, f"{path}[{i}]")


def validate_body(model_cls, body: dict, what: str | None = None):
    """Builds the client's own model from a request body and refuses anything it would not
    send as given: an unknown key (the generated models keep those quietly in
    `additional_properties`, at any depth), a value of the wrong type (the models' Strict types),
    a missing required field, or a value the model would send differently."""
    what = what or model_cls.__name__
    if not isinstance(body, dict):
        raise ShimError(f"{what}: the body must be an object")
    unknown = sorted(set(body) - set(_known_keys(model_cls)))
    if unknown:
        raise ShimError(f"{what}: unknown field(s) {unknown}")
    try:
        obj = model_cls.from_dict(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ShimError(f"{what}.{loc}: {first['msg']}") from None
    _no_extras(obj, what)
    back = obj.to_dict()
    for k, v in body.items():
        if back.get(k) != v:
            raise ShimError(f"{what}.{k}: the client would send {back.get(k)!r}, not {v!r}")
    return obj


@dataclass
class Request:
    api: str          # "SandboxApi.create_sandbox"
    model: str | None
    body: dict | None
    method: str = ""
    url: str = ""
    redact: tuple = ()
    args: tuple = ()   # path parameters, before the body

    def json(self) -> dict:
        body = self.body
        if body is not None and self.redact:
            body = {k: (common.REDACTED if k in self.redact else v) for k, v in body.items()}
        d = {"call": self.api, "method": self.method, "url": self.url}
        if self.model:
            d["model"] = self.model
            d["body"] = body
        return d


def _client(api_url: str, api_key: str | None):
    import daytona_api_client as d
    conf = d.Configuration(host=api_url, access_token=api_key or "dry-run")
    return d.ApiClient(conf)


def serialize(client, req: Request, *args) -> Request:
    """Fills method and URL from the client's own request serialiser (nothing is sent)."""
    import daytona_api_client as d
    api_name, op = req.api.split(".")
    api = getattr(d, api_name)(client)
    body_args = ()
    if req.model:
        body_args = (validate_body(getattr(d, req.model), req.body),)
    method, url, _headers, _body, _ = getattr(api, f"_{op}_serialize")(
        *args, *body_args, None, None, None, None, 0)
    req.method, req.url, req.args = method, url, args
    return req


def _names(box: str) -> dict[str, str]:
    return {"sandbox": f"sandboxer-{box}", "secret": f"sandboxer-token-{box}"}


def _local_copies(dockerfile: str) -> list[str]:
    """COPY/ADD lines that read the build context (not another stage, not a URL)."""
    lines, out = dockerfile.replace("\\\n", " ").splitlines(), []
    for line in lines:
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        if any(w.startswith("--from=") for w in words[1:]):
            continue
        srcs = [w for w in words[1:-1] if not w.startswith("--")]
        if any("://" not in w for w in srcs):
            out.append(line.strip())
    return out


def _dockerfile_text(opts) -> str:
    try:
        return pathlib.Path(opts.dockerfile).read_text()
    except OSError as e:
        raise ShimError(f"read {opts.dockerfile}: {e.strerror}") from None


def _snapshot_body(opts, name: str, entrypoint: list[str]) -> dict:
    body: dict[str, Any] = {"name": name, "entrypoint": entrypoint}
    if opts.dockerfile:
        content = _dockerfile_text(opts)
        local = _local_copies(content)
        if local:
            raise ShimError(
                f"{opts.dockerfile}: {local[0]!r} copies files from the build context; Daytona "
                "builds a snapshot from the Dockerfile's text alone and this shim uploads no "
                "context: push the image to a registry and use --image")
        body["buildInfo"] = {"dockerfileContent": content}
    else:
        body["imageName"] = opts.image
    if opts.sandbox_class:
        body["sandboxClass"] = opts.sandbox_class
    return body


def _sandbox_requests(client, opts, box: str, snapshot: str, token: str, labels: dict,
                      volume: bool = True, command: list[str] | None = None) -> list[Request]:
    n = _names(box)
    secret = Request("SecretApi.create_secret", "CreateSecret",
                     {"name": n["secret"], "value": token,
                      "description": f"sandboxer box {box}: WebSocket token"}, redact=("value",))
    sandbox = Request("SandboxApi.create_sandbox", "CreateSandbox", {
        "name": n["sandbox"], "snapshot": snapshot,
        "secrets": [{TOKEN_ENV: n["secret"]}],
        "labels": {"sandboxer.box": box, **labels},
        "public": opts.public,
        "autoStopInterval": 0,
    })
    if command:
        sandbox.body["env"] = {COMMAND_ENV: json.dumps(command)}
    if volume:
        sandbox.body["volumes"] = [{"volumeId": opts.volume, "mountPath": ARCHIVE_DIR}]
    preview = Request("SandboxApi.get_port_preview_url", None, None)
    return [serialize(client, secret), serialize(client, sandbox),
            serialize(client, preview, n["sandbox"], PORT)]


def _snapshot_name(prefix: str, opts, entrypoint: list[str]) -> str:
    """A snapshot's name says what it holds (image or Dockerfile, class, entrypoint), so an
    existing snapshot of that name, reused on a 409, is the same one."""
    source = _dockerfile_text(opts) if opts.dockerfile else opts.image
    what = json.dumps([source, opts.sandbox_class, entrypoint])
    return f"{prefix}-{hashlib.sha256(what.encode()).hexdigest()[:8]}"


def plan_up(client, opts, box: str, token: str) -> list[Request]:
    entry = common.init_argv(profile=opts.profile, command_env=COMMAND_ENV)
    snap = _snapshot_name(f"sandboxer-{opts.snapshot_tag}", opts, entry)
    reqs = [serialize(client, Request("VolumesApi.create_volume", "CreateVolume", {"name": opts.volume})),
            serialize(client, Request("SnapshotsApi.create_snapshot", "CreateSnapshot",
                                      _snapshot_body(opts, snap, entry)))]
    return reqs + _sandbox_requests(client, opts, box, snap, token, {}, command=opts.command)


def plan_fork(client, opts, boxes: list[str], tokens: list[str]) -> list[Request]:
    if opts.source:
        # Over the box API: idle boxes from the snapshot `up` uses, no volume.
        entry = common.init_argv(profile=opts.profile)
        snap = _snapshot_name(f"sandboxer-{opts.snapshot_tag}", opts, entry)
        reqs = [serialize(client, Request("SnapshotsApi.create_snapshot", "CreateSnapshot",
                                          _snapshot_body(opts, snap, entry)))]
        for i, (box, token) in enumerate(zip(boxes, tokens)):
            reqs += _sandbox_requests(client, opts, box, snap, token,
                                      {"sandboxer.snapshot": opts.snapshot, "sandboxer.index": str(i)},
                                      volume=False)
        return reqs
    entry = common.init_argv(restore=opts.snapshot, profile=opts.profile)
    snap = _snapshot_name(f"sandboxer-restore-{opts.snapshot}", opts, entry)
    reqs = [serialize(client, Request("SnapshotsApi.create_snapshot", "CreateSnapshot",
                                      _snapshot_body(opts, snap, entry)))]
    for i, (box, token) in enumerate(zip(boxes, tokens)):
        reqs += _sandbox_requests(client, opts, box, snap, token,
                                  {"sandboxer.snapshot": opts.snapshot, "sandboxer.index": str(i)})
    return reqs


def plan_down(client, opts) -> list[Request]:
    return [serialize(client, Request("SandboxApi.delete_sandbox", None, None), opts.sandbox)]


def _box_options(sp) -> None:
    sp.add_argument("--class", dest="sandbox_class", choices=["container", "linux-vm"],
                    help="linux-vm can grant the capabilities live checkpoint needs")
    sp.add_argument("--volume", default="sandboxer-archives")
    sp.add_argument("--snapshot-tag", default="agent-0.1.0", help="name of the image's snapshot")
    sp.add_argument("--public", action="store_true",
                    help="preview URL reachable without Daytona's preview token (the box token "
                         "still guards every connection)")


def _parser() -> argparse.ArgumentParser:
    bp = common.box_parser("python -m shims.daytona", __doc__.split("\n\n")[0], _box_options,
                           dockerfile_help="build the snapshot from this Dockerfile")
    bp.parser.add_argument("--api-url", default=DEFAULT_API)
    bp.fork.add_argument("--from", dest="source", help="the URL of the box the snapshot is in (over the box API)")
    bp.fork.add_argument("--from-token-file", dest="source_token_file", help="that box's token")
    dn = bp.ops.add_parser("down", help="delete a box")
    dn.add_argument("sandbox")
    dn.add_argument("--dry-run", action="store_true")
    return bp.parser


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    try:
        if opts.op != "down":
            common.check_box_args(opts, max_copies=64, text_host="Daytona")
        if opts.op == "fork" and opts.source:
            common.check_source_url(opts.source)
            if not opts.public:
                raise ShimError("fork --from: needs --public (the CLI that moves the snapshot in does not "
                                "send Daytona's preview token; the box token still guards every connection)")
        client = _client(opts.api_url, None)
        if opts.op == "up":
            boxes, tokens = [secrets.token_hex(6)], [common.new_token()]
            reqs = plan_up(client, opts, boxes[0], tokens[0])
        elif opts.op == "fork":
            boxes = [f"{opts.snapshot}-{secrets.token_hex(4)}" for _ in range(opts.n)]
            tokens = [common.new_token() for _ in range(opts.n)]
            reqs = plan_fork(client, opts, boxes, tokens)
        else:
            reqs = plan_down(client, opts)
        if opts.dry_run:
            import daytona_api_client
            plan = {"host": "daytona", "sdk": f"daytona-api-client {daytona_api_client.__version__}",
                    "op": opts.op,
                    "checked": "every body built into the client's own model, extra keys refused",
                    "requests": [r.json() for r in reqs]}
            if opts.op == "fork" and opts.source:
                # Then, once each sandbox's preview URL answers, the CLI moves the snapshot in.
                plan["then"] = common.api_fork_argv(opts.source, opts.snapshot,
                                                    [f"<wss preview URL of sandboxer-{b}>" for b in boxes],
                                                    opts.source_token_file)
            common.print_plan(plan)
            return 0
        return _live(opts, reqs, boxes if opts.op != "down" else [], tokens if opts.op != "down" else [])
    except ShimError as e:
        print(f"sandboxer daytona: {e}", file=sys.stderr)
        return 2


def _wait(state, want: str, bad: tuple, what: str, timeout: float = 600) -> None:
    """Polls a Daytona object until it reaches `want`; creation requests return before that."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        s = state()
        s = getattr(s, "value", s)
        if s == want:
            return
        if s in bad:
            raise ShimError(f"{what}: {s}")
        if time.monotonic() > deadline:
            raise ShimError(f"{what}: still {s} after {timeout:.0f} s")
        time.sleep(2)


def _live(opts, reqs: list[Request], boxes: list[str], tokens: list[str]) -> int:
    """Sends the same requests with the real client (needs DAYTONA_API_KEY)."""
    import os
    import daytona_api_client as d
    key = os.environ.get("DAYTONA_API_KEY")
    if not key:
        raise ShimError("DAYTONA_API_KEY is not set")
    client = _client(opts.api_url, key)
    sandbox_api = d.SandboxApi(client)
    previews = []
    for r in reqs:
        api_name, op = r.api.split(".")
        api = getattr(d, api_name)(client)
        body = (validate_body(getattr(d, r.model), r.body),) if r.model else ()
        try:
            result = getattr(api, op)(*r.args, *body)
        except d.ApiException as e:
            # An existing volume or snapshot of the same name is the one to reuse.
            if e.status == 409 and op in ("create_volume", "create_snapshot"):
                continue
            raise ShimError(f"{r.api}: {e.status} {e.reason}") from None
        if op == "create_snapshot":
            _wait(lambda: api.get_snapshot(r.body["name"]).state, "active",
                  ("build_failed", "error"), f"snapshot {r.body['name']}")
        elif op == "create_sandbox":
            _wait(lambda: api.get_sandbox(r.body["name"]).state, "started",
                  ("error", "build_failed", "destroyed"), f"sandbox {r.body['name']}")
        elif op == "get_port_preview_url":
            previews.append(result)
    if opts.op == "fork" and opts.source:
        return _fork_over_api(opts, sandbox_api, previews, boxes, tokens)
    for i, p in enumerate(previews):
        url = "wss://" + p.url.split("://", 1)[-1]
        common.save_token(url, tokens[i])
        print(f"{boxes[i]} {url}" if opts.op == "fork" else url)
    return 0


def _fork_over_api(opts, sandbox_api, previews, boxes: list[str], tokens: list[str]) -> int:
    """The idle sandboxes become copies of the snapshot over the box API; any failure deletes
    every one of them."""
    urls = ["wss://" + p.url.split("://", 1)[-1] for p in previews]

    def remove_all():
        for box in boxes:
            sandbox_api.delete_sandbox(_names(box)["sandbox"])

    common.fork_into_idle_boxes(opts, urls, tokens, remove_all)
    for box, url in zip(boxes, urls):
        print(f"{box} {url}")
    return 0
