#!/usr/bin/env python3
"""The same pattern with the Claude Agent SDK (PyPI `claude-agent-sdk`): the SDK keeps each
session as a transcript under CLAUDE_CONFIG_DIR, so pointing that into the workspace puts the
transcripts in every filesystem snapshot; on a cold restart (SANDBOXER_RESUMED=1) the agent
continues the most recent conversation in its working directory instead of starting over.

Needs the SDK in the image and a model API key (through the broker); not run in the tests here,
which have neither. The option names (`cwd`, `env`, `continue_conversation`, `permission_mode`)
are those of claude-agent-sdk 0.2.184."""
import asyncio
import dataclasses
import json
import os
import pathlib

from claude_agent_sdk import ClaudeAgentOptions, query

WORKSPACE = pathlib.Path(os.environ.get("SANDBOXER_WORKSPACE", os.getcwd()))
TASK = os.environ.get("AGENT_TASK", "Write primes.py that prints the first 50 primes, run it, and check the output.")


async def main() -> None:
    resumed = os.environ.get("SANDBOXER_RESUMED") == "1"
    config_dir = str(WORKSPACE / ".claude")
    # Both the SDK (which reads sessions) and the CLI it starts (which writes them) look here.
    os.environ["CLAUDE_CONFIG_DIR"] = config_dir
    options = ClaudeAgentOptions(
        cwd=str(WORKSPACE),
        env={"CLAUDE_CONFIG_DIR": config_dir},
        continue_conversation=resumed,
        permission_mode="acceptEdits",
    )
    prompt = ("You were restarted from a snapshot of your files; your memory of running "
              "processes is gone. Check the workspace and continue the task.") if resumed else TASK
    print(json.dumps({"step": "resumed" if resumed else "start",
                      "snapshot": os.environ.get("SANDBOXER_SNAPSHOT")}), flush=True)
    async for message in query(prompt=prompt, options=options):
        # One JSON line per SDK message: the supervisor journals each as a proc.message.
        body = dataclasses.asdict(message) if dataclasses.is_dataclass(message) else {"repr": repr(message)}
        print(json.dumps({"step": type(message).__name__, **body}, default=str), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
