"""A Claude Agent SDK agent for sandboxer: its API traffic goes through the box's credential
broker. It holds only a placeholder key and ANTHROPIC_BASE_URL pointing at the broker (both set
by the profile); the broker injects the real key on the way to the API.

    python3 agent.py "your prompt"
"""
import asyncio
import json
import os
import sys

from claude_agent_sdk import AssistantMessage, ClaudeAgentOptions, ResultMessage, TextBlock, query


async def main(prompt):
    # The CLI keeps its state under HOME; the box's root is read-only, its /tmp is its own.
    home = os.environ.get("SBX_AGENT_HOME", "/tmp/claude-home")
    os.makedirs(home, exist_ok=True)
    env = {"HOME": home, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    options = ClaudeAgentOptions(env=env, max_turns=1, allowed_tools=[], cwd=os.getcwd())
    async for msg in query(prompt=prompt, options=options):
        if isinstance(msg, AssistantMessage):
            for block in msg.content:
                if isinstance(block, TextBlock):
                    print(json.dumps({"assistant": block.text}), flush=True)
        elif isinstance(msg, ResultMessage):
            print(json.dumps({"result": msg.result, "is_error": msg.is_error}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "Say hello."))
