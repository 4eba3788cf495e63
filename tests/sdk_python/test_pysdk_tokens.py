"""Where the SDK finds the box token: argument, SANDBOXER_TOKEN, then the CLI's token store."""
import os
import stat

import pytest

from sandboxer import AuthError
from sandboxer import tokens


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("SANDBOXER_TOKEN", raising=False)
    return tmp_path


def test_store_path_is_the_clis_key_of_the_url(env):
    # The same file name cli/tokens.cpp gives it, so a box the CLI started needs no token here.
    p = tokens.token_path("ws://127.0.0.1:7000/")
    assert p == env / "sandboxer" / "tokens" / "ws%3A%2F%2F127.0.0.1%3A7000"
    assert tokens.token_key("WSS://Box-1.example:443/x/#frag") == "wss%3A%2F%2Fbox-1.example%3A443%2Fx"


def test_argument_wins_over_env_and_store(env, monkeypatch):
    tokens.store_token("ws://h:1", "stored")
    monkeypatch.setenv("SANDBOXER_TOKEN", "fromenv")
    assert tokens.resolve_token("ws://h:1", "given") == "given"
    assert tokens.resolve_token("ws://h:1") == "fromenv"


def test_store_is_used_and_private(env):
    p = tokens.store_token("ws://h:1", "stored")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert tokens.resolve_token("ws://h:1/") == "stored"


def test_token_file_argument(env, tmp_path):
    f = tmp_path / "tok"
    f.write_text("  abc\n")
    assert tokens.resolve_token("ws://h:1", token_file=str(f)) == "abc"


def test_no_token_anywhere_names_the_places(env):
    with pytest.raises(AuthError, match="SANDBOXER_TOKEN") as e:
        tokens.resolve_token("ws://h:2")
    assert e.value.code == "unauthorized"
