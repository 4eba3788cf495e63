"""What every shim shares: the in-box command line, the paths inside the image, the token, and
the dry-run record.

The supervisor's flags used here are the ones sandboxer-init reads (`--listen`, `--state-dir`,
`--token-file`, `--profile`, `--idle`, `--restore FILE`; see `sandboxer-init --help`).
Where a host can only hand over secrets as environment variables (Modal, Daytona), the token
travels as `SANDBOXER_TOKEN`, which sandboxer-init reads and removes from its own environment
before it starts anything: the agent never sees it, and it is never on a command line.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

# The WebSocket port inside the box. Hosts map it to their own URL (tunnel, preview, Service).
PORT = 7777
# The supervisor's journal and branch state. On a volume or tmpfs of its own: an overlay upper
# directory cannot sit on the container's own overlay root (docs/architecture.md).
STATE_DIR = "/var/lib/sandboxer/box"
# A box started on a copy of another box's whole filesystem (Modal's snapshot_filesystem) keeps
# the parent's journal where it was and writes its own here.
FORK_STATE_DIR = "/var/lib/sandboxer/fork"
# Where each host mounts its archive store (Modal Volume, Daytona volume, PVC). A fork's boxes
# restore `ARCHIVE_DIR/<snapshot>` from it.
ARCHIVE_DIR = "/var/lib/sandboxer/archives"
TOKEN_ENV = "SANDBOXER_TOKEN"
# Where Kubernetes mounts the token Secret (a file, read with --token-file).
TOKEN_DIR = "/etc/sandboxer/secret"
TOKEN_FILE = f"{TOKEN_DIR}/token"
DEFAULT_IMAGE = "sandboxer/agent:0.1.0"
# The capabilities criu needs inside a container (docs/architecture.md, checked with Docker on
# these machines). A profile without checkpoint gets none of them.
LIVE_CHECKPOINT_CAPS = ("SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "SYS_TIME")
# Docker's and Kubernetes' stop timeouts must exceed the supervisor's grace (10 s by default),
# so the journal is complete when the container stops.
DEFAULT_GRACE_S = 10
STOP_MARGIN_S = 5
REDACTED = "<redacted>"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


class ShimError(Exception):
    """A bad input or an impossible request; the message names what was wrong."""


def init_argv(*, command: Sequence[str] = (), restore: str | None = None,
              token_file: str | None = None, profile: str | None = None,
              port: int = PORT, state_dir: str = STATE_DIR, sets: Sequence[str] = (),
              command_env: str | None = None) -> list[str]:
    """The command line of sandboxer-init inside the box: serve the WebSocket on PORT, and run
    COMMAND, or the command each sandbox has in its variable `command_env` (a JSON array), or
    restore a snapshot from the archive store, or wait idle (for a restore or fork)."""
    if sum(map(bool, (command, restore, command_env))) > 1:
        raise ShimError("a box runs a command, a command from its environment or a restored snapshot: one of them")
    argv = ["sandboxer-init", "--listen", f"0.0.0.0:{port}", "--state-dir", state_dir]
    if token_file:
        argv += ["--token-file", token_file]
    if profile:
        argv += ["--profile", profile]
    for s in sets:  # profile overrides, FIELD=VALUE
        argv += ["--set", s]
    if restore:
        check_name("snapshot", restore)
        argv += ["--restore", f"{ARCHIVE_DIR}/{restore}"]
    elif command_env:
        argv += ["--command-env", command_env]
    elif not command:
        argv += ["--idle"]
    if command:
        argv += ["--", *command]
    return argv


@dataclass
class BoxParser:
    """A shim's command line: `up` and `fork` as every shim takes them, with its own options."""
    parser: argparse.ArgumentParser
    ops: Any  # the subparsers, for a shim's own operations (down)
    up: argparse.ArgumentParser
    fork: argparse.ArgumentParser


def box_parser(prog: str, description: str, box_options: Callable[[argparse.ArgumentParser], None], *,
               dockerfile_help: str | None = None, image_help: str | None = None,
               dry_run_help: str | None = None, fork_command: bool = False) -> BoxParser:
    """The one parser of `up` and `fork` for every shim. Both take --image (or, with
    `dockerfile_help`, --dockerfile instead), --profile, --dry-run and the shim's own
    `box_options`; `up` takes the agent's command after --, `fork` --snapshot S and -n N (and a
    command too with `fork_command`). argparse refuses what does not parse (exit 2, its usage);
    check_box_args what parses but cannot be done."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    ops = p.add_subparsers(dest="op", required=True)
    parsers = {}
    for op, what in (("up", "start a box"), ("fork", "start N boxes from one snapshot")):
        sp = ops.add_parser(op, help=what)
        image = sp
        if dockerfile_help:
            image = sp.add_mutually_exclusive_group()
        image.add_argument("--image", default=DEFAULT_IMAGE, help=image_help)
        if dockerfile_help:
            image.add_argument("--dockerfile", help=dockerfile_help)
        sp.add_argument("--profile")
        sp.add_argument("--dry-run", action="store_true", help=dry_run_help)
        box_options(sp)
        if op == "fork":
            sp.add_argument("--snapshot", required=True)
            sp.add_argument("-n", type=int, required=True)
        if op == "up" or fork_command:
            sp.add_argument("command", nargs="*")
        parsers[op] = sp
    return BoxParser(p, ops, parsers["up"], parsers["fork"])


def check_box_args(opts, *, max_copies: int, text_host: str | None) -> None:
    """What `up` and `fork` refuse in every shim, with the same words: no command for `up`; a
    snapshot name outside check_name's subset, or -n outside 1..max_copies, for `fork`; where the
    host's API carries the agent's command as text (`text_host` names it), a word that is not
    UTF-8."""
    if opts.op == "up" and not opts.command:
        raise ShimError("up: give the agent's command after --")
    if text_host:
        check_text_command(getattr(opts, "command", None) or [], text_host)
    if opts.op == "fork":
        check_name("snapshot", opts.snapshot)
        if not 1 <= opts.n <= max_copies:
            raise ShimError(f"fork: -n {opts.n}: between 1 and {max_copies}")


def check_text_command(words: Sequence[str], host: str) -> None:
    """A command word that is not UTF-8 (Python has its bytes surrogate-escaped) cannot cross an
    API that takes text (Modal's calls, Kubernetes' manifests, Daytona's variables): it would
    reach the box with U+FFFD for its bytes, a different argument, or fail inside the host's SDK.
    Refused, naming the word, as `sandboxer up` refuses one for docker; `sandboxer run` takes any
    bytes."""
    for i, w in enumerate(words):
        try:
            w.encode("utf-8")
        except UnicodeEncodeError:
            raise ShimError(f"command word {i} {os.fsencode(w)!r} is not UTF-8: a box's command reaches "
                            f"{host} as text (sandboxer run takes any bytes)") from None


def check_name(what: str, name: str) -> str:
    """Names that end up in URLs, volume paths and resource names: a safe subset."""
    ok = name and len(name) <= 63 and all(c.isalnum() or c in "-_." for c in name)
    if not ok or name[0] in "-." or name in (".", ".."):
        raise ShimError(f"{what} {name!r}: use 1-63 letters, digits, '-', '_' or '.'")
    return name


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_token_file(path: str) -> str:
    try:
        token = pathlib.Path(path).read_text().strip()
    except OSError as e:
        raise ShimError(f"read token file {path}: {e.strerror}") from None
    if not token:
        raise ShimError(f"token file {path} is empty")
    return token


# The token store is sdk/python's (the same file names the CLI uses): one implementation, so the
# shims, the SDK and cli/tokens.cpp cannot drift apart.
from sandboxer.tokens import store_token as save_token  # noqa: E402,F401
from sandboxer.tokens import token_path  # noqa: E402,F401


# -- fork and migrate over the box API (issue 17) ------------------------------------------------
# The one path for every host: the shim starts boxes idle (`sandboxer-init --idle`) and learns their
# URLs; the CLI then streams the snapshot out of the source box into each (`sandboxer fork URL
# --snapshot S --to URL...`, or `sandboxer migrate URL --to URL`) and asks each to restore it. No
# store is shared between the CLI, the source and the new boxes. The shim keeps each new box's
# token where the CLI finds it by URL (save_token), so the command lines carry no token.


def sandboxer_cli() -> str:
    """The host CLI: $SANDBOXER_CLI, else this checkout's build, else `sandboxer` on PATH."""
    for c in (os.environ.get("SANDBOXER_CLI"), str(REPO_ROOT / "build" / "bin" / "sandboxer"),
              shutil.which("sandboxer")):
        if c and os.access(c, os.X_OK):
            return c
    raise ShimError("no sandboxer CLI: build it (scripts/build), put it on PATH or set SANDBOXER_CLI")


def check_source_url(url: str) -> str:
    if not url.startswith(("ws://", "wss://")) or len(url) > 1024 or any(ord(c) < 0x21 for c in url):
        raise ShimError(f"--from {url!r}: the source box's ws:// or wss:// URL")
    return url


def api_fork_argv(source: str, snapshot: str, urls: Sequence[str], source_token_file: str | None = None) -> list[str]:
    """The CLI's fork of `snapshot` from the box at `source` into the idle boxes at `urls`, copy i
    into the i-th."""
    argv = ["sandboxer", "fork", check_source_url(source), "--snapshot", check_name("snapshot", snapshot)]
    if source_token_file:
        argv += ["--token-file", source_token_file]
    for u in urls:
        argv += ["--to", u]
    return argv


def api_migrate_argv(source: str, url: str, source_token_file: str | None = None) -> list[str]:
    """The CLI's migrate of the box at `source` into the idle box at `url`."""
    argv = ["sandboxer", "migrate", check_source_url(source), "--to", url]
    if source_token_file:
        argv += ["--token-file", source_token_file]
    return argv


def wait_serving(url: str, token: str, *, timeout: float = 300) -> None:
    """Until the box at `url` answers a request with `token` (a host reports a box started before
    its supervisor listens, and its tunnel or Service may come later still). A refused token is
    an error at once."""
    import asyncio

    from sandboxer.connection import open_ws
    from sandboxer.errors import AuthError

    async def once() -> None:
        ws = await open_ws(url, token, open_timeout=10)
        try:
            await ws.send(json.dumps({"id": 1, "op": "stats"}))
            while True:
                if json.loads(await asyncio.wait_for(ws.recv(), 10)).get("id") == 1:
                    return
        finally:
            await ws.close()

    deadline = time.monotonic() + timeout
    while True:
        try:
            asyncio.run(once())
            return
        except AuthError as e:
            raise ShimError(str(e)) from None
        except Exception as e:  # noqa: BLE001 (any failure to answer is "not yet")
            if time.monotonic() > deadline:
                raise ShimError(f"{url}: not serving after {timeout:.0f} s ({type(e).__name__}: {e})") from None
            time.sleep(1)


def run_cli(argv: list[str]) -> list[str]:
    """Runs a planned CLI command (argv[0] "sandboxer" is the CLI found here); its stderr goes to
    the shim's. Returns its stdout's lines; raises ShimError with its exit status on a failure."""
    p = subprocess.run([sandboxer_cli(), *argv[1:]], stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise ShimError(f"{' '.join(argv[:2])} exited {p.returncode} (its reasons above)")
    return p.stdout.splitlines()


def fork_into_idle_boxes(opts, urls: Sequence[str], tokens: Sequence[str], remove_all) -> None:
    """The idle boxes at `urls` (tokens in the same order) become copies of `opts.snapshot` of
    the box at `opts.source` over the box API: each token stored, each box waited for, then the
    CLI's fork. On any failure, or an interrupt, `remove_all()` removes every one of them first."""
    try:
        for url, token in zip(urls, tokens):
            save_token(url, token)
            wait_serving(url, token)
        run_cli(api_fork_argv(opts.source, opts.snapshot, urls, opts.source_token_file))
    except BaseException:
        remove_all()
        raise


def print_plan(plan: dict[str, Any], out=None) -> None:
    """A dry-run's output: one JSON document, the exact calls or manifests, secrets redacted."""
    out = out or sys.stdout
    json.dump(plan, out, indent=2, sort_keys=False)
    out.write("\n")
