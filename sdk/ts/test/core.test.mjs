// The browser-safe core with a WHATWG WebSocket (Node's own, behind --experimental-websocket on
// Node 20; the same API as a browser's): the token only explicit and in an auth frame, binary
// frames as ArrayBuffers. Skipped where this Node has no WebSocket at all (Node 18).
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { promisify } from "node:util";
import { test } from "node:test";
import { startBox } from "./helpers.mjs";

const run = promisify(execFile);

test("the core with the platform's WebSocket: auth frame, exec with binary stdin, files, events", async (t) => {
  const server = await startBox();
  try {
    const flag = process.versions.node.split(".")[0] < 22 ? ["--experimental-websocket"] : [];
    let stdout;
    try {
      ({ stdout } = await run(process.execPath, [...flag, "--no-warnings", new URL("./core-client.mjs", import.meta.url).pathname, server.url, server.token], {
        env: { ...process.env, SANDBOXER_TOKEN: server.token }, // must not be used: the core takes only an explicit token
        timeout: 60_000,
      }));
    } catch (e) {
      if (/bad option/.test(String(e.stderr))) return t.skip("this Node has no WebSocket");
      throw e;
    }
    const out = JSON.parse(stdout);
    if (!out.hasWebSocket) return t.skip("this Node has no WebSocket");
    assert.equal(out.wrong, "unauthorized");
    assert.match(out.none, /only an explicit token/);
    assert.equal(out.exit, 0);
    assert.match(out.stdout, /ff 00 fe/);
    assert.equal(out.same, true);
    assert.equal(out.first, "box.started");
  } finally {
    await server.stop();
  }
});
