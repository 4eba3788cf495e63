"""examples/claude-agent and examples/claude-agent-ts: the real Claude Agent SDK for Python and for
TypeScript (and the Claude Code CLI each brings) in a box under the claude-agent profile, its API
calls through the credential broker to a local stand-in API over TLS. The TypeScript agent's
replies also reach the journal through the agent channel (sdk/ts's agent module)."""
import json
import secrets
import shutil
import sys

import pytest

from sbxtest import ROOT, clean_env, make_tls, read_journal, run_init

EXAMPLE = ROOT / "examples" / "claude-agent"
PYTHON = EXAMPLE / ".venv" / "bin" / "python"
EXAMPLE_TS = ROOT / "examples" / "claude-agent-ts"
AGENT_TS = EXAMPLE_TS / "dist" / "agent.js"
SDK_TS = EXAMPLE_TS / "node_modules" / "@anthropic-ai" / "claude-agent-sdk"
NODE = shutil.which("node")

sys.path.insert(0, str(EXAMPLE))
from standin import REPLY, StandIn  # noqa: E402


def run_through_broker(tmp_path, example, argv):
    """Runs `argv` under `example`'s profile, bound to the stand-in API instead of
    api.anthropic.com, and checks what both examples promise: the agent's reply arrives, the
    stand-in got the real key (injected by the broker), and neither the journal nor the agent's
    start nor the supervisor's stderr holds it. Returns the journal's events."""
    ca, cert, key = make_tls(tmp_path)  # the certificate names api.example.test
    secret = "sk-ant-test-" + secrets.token_hex(16)
    api = StandIn(secret, 0, str(cert), str(key))
    profile = json.loads((example / "profile.json").read_text())
    profile["network"]["allow"] = ["api.example.test"]
    profile["network"]["resolve"] = {"api.example.test": "127.0.0.1"}
    profile["network"]["allow_cidrs"] = ["127.0.0.1"]  # the stand-in API listens on loopback
    cred = profile["credentials"][0]
    cred["bind"].update(host="api.example.test", port=api.port)
    cred["ca_file"] = str(ca)
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    state = tmp_path / "state"
    env = clean_env(ANTHROPIC_API_KEY=secret)
    try:
        r = run_init(["--profile", str(tmp_path / "profile.json"), "--", *argv], state, timeout=100, env=env)
    finally:
        api.close()
    events = read_journal(state)
    messages = [e["message"] for e in events if e["type"] == "proc.message"]
    output = "".join(e.get("data", "") for e in events if e["type"] == "proc.output")
    assert r.returncode == 0, (r.stderr.decode()[-2000:], output[-3000:])
    assert {"assistant": REPLY} in messages, output[-3000:]
    calls = [q for q in api.requests if q["path"].startswith("/v1/messages")]
    assert calls and all(q["key_ok"] for q in calls)
    assert secret not in json.dumps(events)
    assert secret not in r.stderr.decode(errors="replace")
    started = [e for e in events if e["type"] == "proc.started"]
    assert started and secret not in json.dumps(started)
    return events, output


@pytest.mark.skipif(not PYTHON.exists(), reason="run examples/claude-agent/setup first (claude-agent-sdk, ~370 MB)")
@pytest.mark.timeout(120)
def test_claude_agent_calls_the_api_through_the_broker(tmp_path):
    run_through_broker(tmp_path, EXAMPLE, [str(PYTHON), str(EXAMPLE / "agent.py"), "Say hello."])


@pytest.mark.skipif(NODE is None, reason="no node on PATH (scripts/install-deps installs Debian's nodejs)")
@pytest.mark.skipif(not (SDK_TS.exists() and AGENT_TS.exists()),
                    reason="run examples/claude-agent-ts/setup first (@anthropic-ai/claude-agent-sdk, ~460 MB)")
@pytest.mark.timeout(120)
def test_claude_agent_ts_calls_the_api_through_the_broker(tmp_path):
    events, output = run_through_broker(tmp_path, EXAMPLE_TS, [NODE, str(AGENT_TS), "Say hello."])
    # The agent channel carried the reply into the journal as an event of its own.
    assert any(e["type"] == "agent.reply" and e.get("text") == REPLY for e in events), output[-3000:]
