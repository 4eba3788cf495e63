"""A box started by `sandboxer run --listen` stores its token under its URL; the SDK finds it."""
import os
import re
import signal
import subprocess
import time

import pytest

from sandboxer import AuthError, Box, ConnectionLost
from sbxtest import CLI, run



def test_sdk_connects_to_a_box_the_cli_started_without_being_given_a_token(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SANDBOXER_TOKEN", raising=False)
    p = subprocess.Popen([str(CLI), "run", "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--",
                          "sh", "-c", "echo hello; sleep 30"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        url, line, deadline = None, b"", time.monotonic() + 20
        while url is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            m = re.search(rb"serving (ws://[0-9.:]+) ", line)
            url = m.group(1).decode() if m else None
        assert url, line

        async def go():
            async with await Box.connect(url) as box:  # no token=, no SANDBOXER_TOKEN
                proc = await box.exec(["echo", "via-stored-token"])
                await proc.wait(10)
                return proc.stdout
        assert run(go(), 30) == b"via-stored-token\n"
        # With no token stored, while the box answers: the token is what is missing.
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "other"))
        with pytest.raises(AuthError, match="no token for"):
            run(Box.connect(url), 30)
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    # Once it has ended, its stored token is gone too: that nothing answers is what is said (it
    # said only where a token could come from, as if the box ran).
    with pytest.raises(ConnectionLost) as e:
        run(Box.connect(url), 30)
    where = url.removeprefix("ws://")
    assert f"; and no box answers at {url}: Connection refused (nothing listens on {where})" in str(e.value), e.value
