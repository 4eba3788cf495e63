"""What every shim shares: the in-box command line, the paths inside the image, the token, and
the dry-run record.

The supervisor's flags used here are the ones sandboxer-init reads (`--listen`, `--state-dir`,
`--token-file`, `--profile`) or that shared/DESIGN.md names for it (`--idle`, `--restore FILE`).
Where a host can only hand over secrets as environment variables (Modal, Daytona), the token
travels as `SANDBOXER_TOKEN`, which sandboxer-init reads and removes from its own environment
before it starts anything: the agent never sees it, and it is never on a command line.
"""
from __future__ import annotations

import json
import pathlib
import secrets
import sys
from typing import Any, Sequence

# The WebSocket port inside the box. Hosts map it to their own URL (tunnel, preview, Service).
PORT = 7777
# The supervisor's journal and branch state. On a volume or tmpfs of its own: an overlay upper
# directory cannot sit on the container's own overlay root (DESIGN.md).
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
# The capabilities criu needs inside a container (DESIGN.md, checked with Docker on these
# machines). A profile without checkpoint gets none of them.
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
              port: int = PORT, state_dir: str = STATE_DIR) -> list[str]:
    """The command line of sandboxer-init inside the box: serve the WebSocket on PORT, and run
    COMMAND, or restore a snapshot from the archive store, or wait idle for an `exec`."""
    if command and restore:
        raise ShimError("a box runs either a command or a restored snapshot, not both")
    argv = ["sandboxer-init", "--listen", f"0.0.0.0:{port}", "--state-dir", state_dir]
    if token_file:
        argv += ["--token-file", token_file]
    if profile:
        argv += ["--profile", profile]
    if restore:
        check_name("snapshot", restore)
        argv += ["--restore", f"{ARCHIVE_DIR}/{restore}"]
    elif not command:
        argv += ["--idle"]
    if command:
        argv += ["--", *command]
    return argv


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


def print_plan(plan: dict[str, Any], out=None) -> None:
    """A dry-run's output: one JSON document, the exact calls or manifests, secrets redacted."""
    out = out or sys.stdout
    json.dump(plan, out, indent=2, sort_keys=False)
    out.write("\n")
