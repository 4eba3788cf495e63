"""The Modal shim, written against Modal's Python SDK (PyPI `modal`, pinned in
shims/requirements.txt).

    python -m shims.modal up   [--image REF | --dockerfile PATH] [options] [--dry-run] -- CMD...
    python -m shims.modal fork --snapshot S -n N --from URL [--from-token-file F] [--dry-run]
    python -m shims.modal fork --snapshot S -n N [--via volume | --via modal-snapshot --sandbox-id ID -- CMD...] [--dry-run]
    python -m shims.modal down SANDBOX_ID [--dry-run]

`up` creates a Sandbox from the image with sandboxer-init as its command, the WebSocket on an
encrypted port (Modal's TLS tunnel), the token as a Modal Secret (the variable SANDBOXER_TOKEN,
which sandboxer-init reads and removes from its environment), and a Volume at ARCHIVE_DIR for
checkpoint archives. It prints the wss:// URL as its last line and keeps the token where the CLI
finds it by URL.

Modal runs gVisor: no CRIU, so the supervisor reports `live_checkpoint: false` and every
checkpoint is a filesystem snapshot. `fork --from URL` (`--via api`) starts N Sandboxes idle
(`sandboxer-init --idle`), waits until each serves, and has the CLI stream snapshot S out of the
box at URL into each and restore it there as copy i (`sandboxer fork URL --snapshot S --to ...`):
a cold restart, the host having no criu; no Volume or shared store is needed, and the source may
be on any host. On a failure every Sandbox it started is terminated. `fork --via volume` starts N Sandboxes that restore one
archive from the Volume (the supervisor's cold restart); `fork --via modal-snapshot` uses Modal's
own `Sandbox.snapshot_filesystem()` of a running box and starts N Sandboxes from that image,
re-running the agent's command with SANDBOXER_RESUMED=1 and SANDBOXER_SNAPSHOT set.

`--dry-run` contacts nothing: it records every SDK call the shim would make, checks each one
against the installed SDK's signatures (shims/sdkcheck.py) and prints them as JSON.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

from .. import common
from ..common import ARCHIVE_DIR, PORT, TOKEN_ENV, ShimError
from ..sdkcheck import Call, Ref, call_json, check_call


# What a call returns, where it is not an object of the class it is called on.
RESULT_KINDS = {"Sandbox.snapshot_filesystem": "Image", "Sandbox.tunnels": "Tunnels",
                "Sandbox.terminate": "Exit"}


class Recorder:
    """Stands in for the SDK in a dry run: records each call and returns a handle."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._ids = itertools.count(1)

    def call(self, path: str, *args: Any, redact: set | None = None, **kwargs: Any) -> Ref:
        kind = RESULT_KINDS.get(path, path.split(".")[0])
        ref = Ref(kind, f"{kind.lower()}#{next(self._ids)}")
        self.calls.append(Call(path, args, kwargs, result=ref, redact=redact or set()))
        return ref

    def method(self, obj: Ref, path: str, *args: Any, **kwargs: Any) -> Ref:
        ref = self.call(path, *args, **kwargs)
        self.calls[-1].on = obj
        return ref


class Live:
    """Makes the same calls on the real SDK."""

    def __init__(self) -> None:
        import modal
        self.modal = modal

    def call(self, path: str, *args: Any, redact: set | None = None, **kwargs: Any) -> Any:
        fn = self.modal
        for part in path.split("."):
            fn = getattr(fn, part)
        return fn(*args, **kwargs)

    def method(self, obj: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, path.split(".")[-1])(*args, **kwargs)


def _image(api, opts) -> Any:
    if opts.dockerfile:
        # The build context is the repository root: images/Dockerfile copies build/bundle and
        # images/ from there.
        image = api.call("Image.from_dockerfile", opts.dockerfile,
                         context_dir=str(common.REPO_ROOT))
    else:
        image = api.call("Image.from_registry", opts.image)
    # Modal starts a registry image's ENTRYPOINT with its own command appended; the image's
    # ENTRYPOINT is sandboxer-init, so it is cleared and Sandbox.create names sandboxer-init
    # itself as the Sandbox's command: one PID 1, exactly the argv the shim printed.
    return api.method(image, "Image.entrypoint", [])


def _sandbox(api, *, app, image, volume, token: str, argv: list[str], opts,
             env: dict[str, str] | None = None) -> Any:
    secret = api.call("Secret.from_dict", {TOKEN_ENV: token}, redact={TOKEN_ENV})
    kwargs: dict[str, Any] = dict(
        app=app, image=image, secrets=[secret], encrypted_ports=[PORT], timeout=opts.timeout,
        workdir="/workspace")
    if volume is not None:
        kwargs["volumes"] = {ARCHIVE_DIR: volume}
    if opts.runtime:
        kwargs["runtime"] = opts.runtime
    if opts.cpu is not None:
        kwargs["cpu"] = opts.cpu
    if opts.memory is not None:
        kwargs["memory"] = opts.memory
    if env:
        kwargs["env"] = env
    return api.call("Sandbox.create", *argv, **kwargs)


def plan_up(api, opts, token: str) -> list[tuple[Any, Any]]:
    """The calls of `up`; returns (sandbox, its tunnels) for the one box."""
    app = api.call("App.lookup", opts.app, create_if_missing=True)
    image = _image(api, opts)
    volume = api.call("Volume.from_name", opts.volume, create_if_missing=True)
    argv = common.init_argv(command=opts.command, profile=opts.profile)
    sb = _sandbox(api, app=app, image=image, volume=volume, token=token, argv=argv, opts=opts)
    return [(sb, api.method(sb, "Sandbox.tunnels"))]


def plan_fork(api, opts, tokens: list[str]) -> list[tuple[Any, Any]]:
    """The calls of `fork`; returns (sandbox, its tunnels) per copy."""
    app = api.call("App.lookup", opts.app, create_if_missing=True)
    # Over the API the snapshot needs no store of the host's: no Volume.
    volume = None if opts.via == "api" else api.call("Volume.from_name", opts.volume, create_if_missing=True)
    boxes = []
    if opts.via == "api":
        image = _image(api, opts)
        for i in range(opts.n):
            boxes.append(_sandbox(api, app=app, image=image, volume=volume, token=tokens[i],
                                  argv=common.init_argv(profile=opts.profile), opts=opts))
    elif opts.via == "volume":
        image = _image(api, opts)
        for i in range(opts.n):
            argv = common.init_argv(restore=opts.snapshot, profile=opts.profile)
            boxes.append(_sandbox(api, app=app, image=image, volume=volume, token=tokens[i],
                                  argv=argv, opts=opts))
    else:
        parent = api.call("Sandbox.from_id", opts.sandbox_id)
        image = api.method(parent, "Sandbox.snapshot_filesystem")
        env = {"SANDBOXER_RESUMED": "1", "SANDBOXER_SNAPSHOT": opts.snapshot}
        for i in range(opts.n):
            argv = common.init_argv(command=opts.command, profile=opts.profile,
                                    state_dir=common.FORK_STATE_DIR)
            boxes.append(_sandbox(api, app=app, image=image, volume=volume, token=tokens[i],
                                  argv=argv, opts=opts, env=env))
    return [(sb, api.method(sb, "Sandbox.tunnels")) for sb in boxes]


def plan_down(api, opts) -> None:
    sb = api.call("Sandbox.from_id", opts.sandbox_id)
    api.method(sb, "Sandbox.terminate")


def check_plan(calls: list[Call]) -> None:
    """Every recorded call against the installed `modal` package's own signatures."""
    import modal
    for c in calls:
        check_call(modal, c)


def _box_options(sp) -> None:
    sp.add_argument("--app", default="sandboxer", help="Modal App the Sandboxes belong to")
    sp.add_argument("--volume", default="sandboxer-archives", help="Modal Volume for archives")
    sp.add_argument("--timeout", type=int, default=24 * 3600, help="Sandbox lifetime, seconds")
    sp.add_argument("--cpu", type=float)
    sp.add_argument("--memory", type=int, help="MiB")
    sp.add_argument("--runtime", choices=["gvisor", "vm"])


def _parser() -> argparse.ArgumentParser:
    bp = common.box_parser("python -m shims.modal", __doc__.split("\n\n")[0], _box_options,
                           image_help="registry image reference",
                           dockerfile_help="build from this Dockerfile (e.g. images/Dockerfile)",
                           fork_command=True)
    bp.fork.add_argument("--via", choices=["api", "volume", "modal-snapshot"],
                         help="api (the default with --from): over the box API from the box at --from; "
                              "volume (the default without): restore the archive from the Volume")
    bp.fork.add_argument("--from", dest="source", help="the URL of the box the snapshot is in (--via api)")
    bp.fork.add_argument("--from-token-file", dest="source_token_file", help="that box's token")
    bp.fork.add_argument("--sandbox-id", help="the running box to snapshot (--via modal-snapshot)")
    dn = bp.ops.add_parser("down", help="terminate a box")
    dn.add_argument("sandbox_id")
    dn.add_argument("--dry-run", action="store_true")
    return bp.parser


def _validate(opts) -> None:
    common.check_box_args(opts, max_copies=64, text_host="Modal")
    if opts.op == "fork":
        if opts.via is None:
            opts.via = "api" if opts.source else "volume"
        if (opts.via == "api") != bool(opts.source):
            raise ShimError("fork: --from URL goes with --via api (the snapshot comes over the box API)")
        if opts.via == "api":
            common.check_source_url(opts.source)
            if opts.command:
                raise ShimError("fork --via api: the command comes from the snapshot; give none")
        if opts.via == "modal-snapshot" and not (opts.sandbox_id and opts.command):
            raise ShimError("fork --via modal-snapshot: needs --sandbox-id and the agent's command after --")
        if opts.via == "volume" and opts.command:
            raise ShimError("fork --via volume: the command comes from the archive; give none")


def _ws_url(tunnels: dict, port: int) -> str:
    url = tunnels[port].url
    return "wss://" + url.split("://", 1)[-1]


def _live(opts, tokens: list[str]) -> int:
    """The same plan on the real SDK (needs Modal credentials, as `modal token set` keeps them)."""
    live = Live()
    try:
        if opts.op == "down":
            plan_down(live, opts)
            return 0
        boxes = plan_up(live, opts, tokens[0]) if opts.op == "up" else plan_fork(live, opts, tokens)
    except live.modal.exception.Error as e:
        raise ShimError(f"{type(e).__name__}: {e}") from None
    if opts.op == "fork" and opts.via == "api":
        return _fork_over_api(live, opts, boxes, [_ws_url(t, PORT) for _, t in boxes], tokens)
    for i, (sb, tunnels) in enumerate(boxes):
        url = _ws_url(tunnels, PORT)
        common.save_token(url, tokens[i])
        # Fork: one line per copy, the Sandbox's id and its URL; up: the URL alone, last.
        print(f"{sb.object_id} {url}" if opts.op == "fork" else url)
    return 0


def _fork_over_api(live, opts, boxes, urls: list[str], tokens: list[str]) -> int:
    """The idle Sandboxes (at `urls`, their tunnels) become copies of the snapshot over the box
    API; any failure terminates every one of them."""

    def remove_all():
        for sb, _ in boxes:
            live.method(sb, "Sandbox.terminate")

    common.fork_into_idle_boxes(opts, urls, tokens, remove_all)
    for (sb, _), url in zip(boxes, urls):
        print(f"{sb.object_id} {url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    try:
        _validate(opts)
        if opts.op == "up":
            tokens = [common.new_token()]
        elif opts.op == "fork":
            tokens = [common.new_token() for _ in range(opts.n)]
        if opts.dry_run:
            rec = Recorder()
            if opts.op == "up":
                plan_up(rec, opts, tokens[0])
            elif opts.op == "fork":
                plan_fork(rec, opts, tokens)
            else:
                plan_down(rec, opts)
            check_plan(rec.calls)
            import modal
            plan = {"host": "modal", "sdk": f"modal {modal.__version__}", "op": opts.op,
                    "checked": "every call bound against the installed SDK's signatures",
                    "calls": [call_json(c) for c in rec.calls]}
            if opts.op == "fork" and opts.via == "api":
                # Then, once each Sandbox's tunnel answers, the CLI moves the snapshot in.
                tunnels = [c.result.id for c in rec.calls if c.path == "Sandbox.tunnels"]
                plan["then"] = common.api_fork_argv(opts.source, opts.snapshot,
                                                    [f"<wss URL of {t}>" for t in tunnels],
                                                    opts.source_token_file)
            common.print_plan(plan)
            return 0
        return _live(opts, tokens if opts.op != "down" else [])
    except ShimError as e:
        print(f"sandboxer modal: {e}", file=sys.stderr)
        return 2
