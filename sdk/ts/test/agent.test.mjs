// The agent module (src/agent.ts) under a real sandboxer-init: a Node agent asks who it is,
// writes events into the journal, and forks itself into two live copies (CRIU) that each return
// from the same fork() call knowing which copy they are. Also its refusals without a channel.
import assert from "node:assert/strict";
import { test } from "node:test";
import { Box } from "../dist/node.js";
import { Channel, ChannelError, parseFds } from "../dist/agent.js";
import { startBox, until } from "./helpers.mjs";

test("a Node agent forks itself through the channel; each copy returns from fork() as itself", async () => {
  const server = await startBox([process.execPath, new URL("./fork-agent.mjs", import.meta.url).pathname]);
  try {
    const box = await Box.connect(server.url, { token: server.token });
    let after = 0;
    const got = await until(box.events({ since: 0 }), (e) => (e.type === "agent.after_fork" && ++after === 3) || e.type === "proc.exited");
    await box.close();
    const hello = got.find((e) => e.type === "agent.hello");
    assert.deepEqual([hello?.branch, hello?.mode], ["main", "original"]);
    const afters = got.filter((e) => e.type === "agent.after_fork");
    assert.equal(afters.length, 3, JSON.stringify(got.map((e) => e.type)));
    const original = afters.find((e) => e.branch === "main");
    assert.equal(original.copy, false);
    const copies = original.copies.map((c) => c.branch).sort();
    assert.equal(copies.length, 2);
    const forked = afters.filter((e) => e.copy === true);
    assert.deepEqual(forked.map((e) => e.branch).sort(), copies);
    for (const e of forked) {
      assert.equal(e.identity.branch, e.branch);
      assert.equal(e.identity.parent, "main");
      assert.equal(e.identity.index, e.index);
    }
    assert.ok(got.some((e) => e.type === "fork.created"));
  } finally {
    await server.stop();
  }
});

test("no channel, or a channel spec that is not fds, is a clear error", () => {
  const saved = process.env.SANDBOXER_CHANNEL_FD;
  delete process.env.SANDBOXER_CHANNEL_FD;
  try {
    assert.throws(() => new Channel(), (e) => e instanceof ChannelError && e.code === "no_channel" && /SANDBOXER_CHANNEL_FD is not set/.test(e.message));
  } finally {
    if (saved !== undefined) process.env.SANDBOXER_CHANNEL_FD = saved;
  }
  assert.throws(() => new Channel("three"), /not an fd/);
  assert.throws(() => parseFds("1,2,3"), /3 fds/);
  assert.deepEqual(parseFds("5"), [5, 5]);
  assert.deepEqual(parseFds("5,6"), [5, 6]);
  assert.throws(() => new Channel("5,6").request("snapshot.delete", { id: "x" }), /cannot be named id/);
});
