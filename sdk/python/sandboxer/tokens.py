"""Where the box token comes from: an explicit argument, SANDBOXER_TOKEN, or the CLI's token
store (one file per URL, mode 0600, under `$XDG_STATE_HOME/sandboxer/tokens/`)."""
from __future__ import annotations

import os
import pathlib
from .errors import AuthError


def state_home() -> pathlib.Path:
    """`$XDG_STATE_HOME`, or `~/.local/state` when it is unset or empty."""
    v = os.environ.get("XDG_STATE_HOME")
    return pathlib.Path(v) if v else pathlib.Path.home() / ".local" / "state"


def _normalized(url: str) -> str:
    """The URL as the CLI keys it: no fragment, scheme and host lower-cased, no trailing '/' on
    the path (cli/tokens.cpp, `normalized`)."""
    url = url.rstrip(" \n").split("#", 1)[0]
    i = url.find("://")
    if i < 0:
        return url
    host_end = len(url)
    for ch in "/?":
        j = url.find(ch, i + 3)
        if j >= 0:
            host_end = min(host_end, j)
    q = url.find("?", host_end)
    path = url[host_end:q if q >= 0 else len(url)].rstrip("/")
    return url[:host_end].lower() + path + (url[q:] if q >= 0 else "")


def token_key(url: str) -> str:
    """The token store's file name for `url`, exactly as the CLI makes it (cli/tokens.cpp): the
    normalized URL with every byte other than a letter, digit, '.', '-', '_' or '~' percent-encoded
    (`ws://127.0.0.1:7000/` -> `ws%3A%2F%2F127.0.0.1%3A7000`)."""
    safe = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-_~")
    return "".join(chr(b) if b in safe else f"%{b:02X}" for b in _normalized(url).encode())


def token_path(url: str) -> pathlib.Path:
    """The token store's file for `url`: `$XDG_STATE_HOME/sandboxer/tokens/<token_key(url)>`."""
    return state_home() / "sandboxer" / "tokens" / token_key(url)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """A token file's contents without surrounding whitespace; an empty file is an error."""
    tok = pathlib.Path(path).read_text().strip()
    if not tok:
        raise AuthError(f"token file {path} is empty")
    return tok


def resolve_token(url: str, token: str | None = None, token_file: str | None = None) -> str:
    """The token to use for `url`: `token`, else `token_file`, else SANDBOXER_TOKEN, else the
    token store. Raises AuthError naming every place it looked when none has one."""
    if token:
        return token
    if token_file:
        return read_token_file(token_file)
    env = os.environ.get("SANDBOXER_TOKEN")
    if env:
        return env.strip()
    p = token_path(url)
    if p.is_file():
        return read_token_file(p)
    raise AuthError(f"no token for {url}: pass token=, set SANDBOXER_TOKEN, or store one in {p}")


def store_token(url: str, token: str) -> pathlib.Path:
    """Saves `token` for `url` in the token store (directory 0700, file 0600); returns the path."""
    p = token_path(url)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(p, 0o600)
    return p
