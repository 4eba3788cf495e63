// An agent for agent.test.mjs, run by a real sandboxer-init: asks the channel who it is, writes an
// event, then forks itself into two live copies; the original and each copy write an event saying
// who they are, then wait.
import { channel, whoami, event, fork } from "../dist/agent.js";

const me = whoami();
event("agent.hello", { branch: me.branch, mode: me.mode ?? null });
const r = fork(2, "ts-fork");
const ch = channel();
event("agent.after_fork", { copy: r.copy === true, branch: r.branch ?? me.branch, index: r.index ?? null, copies: r.copies ?? null, identity: ch.identity });
setInterval(() => {}, 1 << 30);
