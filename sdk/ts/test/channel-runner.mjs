// An agent for the channel tests: makes one sandboxer agent-module call (named by argv[2]) over
// SANDBOXER_CHANNEL_FD and prints {reply, identity} or {error: {code, detail}} on stdout.
import { Channel, ChannelError } from "../dist/agent.js";

const S = "s-0123456789abcdef";
const CALLS = {
  "whoami": (ch) => ch.whoami(),
  "checkpoint": (ch) => ch.checkpoint("before-step-3"),
  "checkpoint that ends the original": (ch) => ch.checkpoint("last", false),
  "event": (ch) => ch.event("agent.note", { text: "hi" }),
  "event with a bare type and the journal's fields": (ch) => ch.event("note", { seq: 1, ts: "x", box: "forged", branch: "f9", proc: "p", n: 2 }),
  "fork": (ch) => ch.fork(4),
  "restore": (ch) => ch.restore(S),
  "snapshot.list": (ch) => ch.snapshots(),
  "snapshot.delete": (ch) => ch.deleteSnapshot(S),
  "raw whoami": (ch) => ch.request("whoami"),
};

const ch = new Channel();
try {
  const reply = CALLS[process.argv[2]](ch);
  process.stdout.write(JSON.stringify({ reply: reply ?? null, identity: ch.identity }));
} catch (e) {
  if (!(e instanceof ChannelError)) throw e;
  process.stdout.write(JSON.stringify({ error: { code: e.code, detail: e.detail } }));
}
