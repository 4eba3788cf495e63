"""examples/claude-agent-ts: the real Claude Agent SDK for TypeScript (and the Claude Code CLI it
brings) in a box under the claude-agent profile, its API calls through the credential broker to
the local stand-in API over TLS; its replies also reach the journal through the agent channel
(sdk/ts's agent module)."""
import json
import secrets
import shutil
import sys

import pytest

from sbxtest import ROOT, make_tls, read_journal, run_init

EXAMPLE = ROOT / "examples" / "claude-agent-ts"
AGENT = EXAMPLE / "dist" / "agent.js"
SDK = EXAMPLE / "node_modules" / "@anthropic-ai" / "claude-agent-sdk"
NODE = shutil.which("node")

sys.path.insert(0, str(ROOT / "examples" / "claude-agent"))
from standin import REPLY, StandIn  # noqa: E402


@pytest.mark.skipif(NODE is None, reason="no node on PATH (scripts/install-deps installs Debian's nodejs)")
@pytest.mark.skipif(not (SDK.exists() and AGENT.exists()),
                    reason="run examples/claude-agent-ts/setup first (@anthropic-ai/claude-agent-sdk, ~460 MB)")
@pytest.mark.timeout(120)
def test_claude_agent_ts_calls_the_api_through_the_broker(tmp_path):
    ca, cert, key = make_tls(tmp_path)  # the certificate names api.example.test
    secret = "sk-ant-test-" + secrets.token_hex(16)
    api = StandIn(secret, 0, str(cert), str(key))
    profile = json.loads((EXAMPLE / "profile.json").read_text())
    # The example's profile, bound to the stand-in instead of api.anthropic.com.
    profile["network"]["allow"] = ["api.example.test"]
    profile["network"]["resolve"] = {"api.example.test": "127.0.0.1"}
    profile["network"]["allow_cidrs"] = ["127.0.0.1"]  # the stand-in API listens on loopback
    cred = profile["credentials"][0]
    cred["bind"].update(host="api.example.test", port=api.port)
    cred["ca_file"] = str(ca)
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    state = tmp_path / "state"
    env = {"PATH": "/usr/bin:/bin", "ANTHROPIC_API_KEY": secret}
    try:
        r = run_init(["--profile", str(tmp_path / "profile.json"), "--", NODE, str(AGENT), "Say hello."],
                     state, timeout=100, env=env)
    finally:
        api.close()
    events = read_journal(state)
    messages = [e["message"] for e in events if e["type"] == "proc.message"]
    output = "".join(e.get("data", "") for e in events if e["type"] == "proc.output")
    assert r.returncode == 0, (r.stderr.decode()[-2000:], output[-3000:])
    assert {"assistant": REPLY} in messages, output[-3000:]
    # The agent channel carried the reply into the journal as an event of its own.
    assert any(e["type"] == "agent.reply" and e.get("text") == REPLY for e in events), output[-3000:]
    # The stand-in got the real key, injected by the broker; the box's record and the agent's
    # environment never hold it.
    calls = [q for q in api.requests if q["path"].startswith("/v1/messages")]
    assert calls and all(q["key_ok"] for q in calls)
    assert secret not in json.dumps(events)
    assert secret not in r.stderr.decode(errors="replace")
    started = [e for e in events if e["type"] == "proc.started"]
    assert started and secret not in json.dumps(started)
