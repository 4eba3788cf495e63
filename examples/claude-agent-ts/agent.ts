/**
 * A Claude Agent SDK (TypeScript) agent for sandboxer: its API traffic goes through the box's
 * credential broker. It holds only a placeholder key and ANTHROPIC_BASE_URL pointing at the
 * broker (both set by the profile); the broker injects the real key on the way to the API.
 *
 *     node dist/agent.js "your prompt"
 *
 * Each reply is printed as a JSON line (a `proc.message` event in the journal) and, through the
 * agent channel, written into the journal as an `agent.reply` event of its own.
 */
import { mkdirSync } from "node:fs";
import { query } from "@anthropic-ai/claude-agent-sdk";
import { event } from "@sandboxer/sdk/agent";

const prompt = process.argv[2] ?? "Say hello.";
// The CLI keeps its state under HOME; the box's root is read-only, its /tmp is its own.
const home = process.env.SBX_AGENT_HOME ?? "/tmp/claude-home";
mkdirSync(home, { recursive: true });
const env = { ...process.env, HOME: home, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: "1", DISABLE_AUTOUPDATER: "1" };

for await (const msg of query({ prompt, options: { env, maxTurns: 1, allowedTools: [], cwd: process.cwd() } })) {
  if (msg.type === "assistant") {
    for (const block of msg.message.content) {
      if (block.type === "text") {
        console.log(JSON.stringify({ assistant: block.text }));
        if (process.env.SANDBOXER_CHANNEL_FD) event("agent.reply", { text: block.text });
      }
    }
  } else if (msg.type === "result") {
    console.log(JSON.stringify({ result: msg.subtype === "success" ? msg.result : null, is_error: msg.is_error }));
  }
}
