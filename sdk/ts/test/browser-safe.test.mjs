// The core (dist/index.js and everything it imports) must load in a browser: the live view
// bundles it. Node-only parts (node.js, tokens.js, agent.js) stay out of its import graph.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { test } from "node:test";

const DIST = join(dirname(fileURLToPath(import.meta.url)), "..", "dist");

function graph(file, seen = new Map()) {
  if (seen.has(file)) return seen;
  const src = readFileSync(join(DIST, file), "utf8");
  seen.set(file, src);
  for (const m of src.matchAll(/(?:import|export)[^'"]*?from\s*["']([^"']+)["']|import\(\s*["']([^"']+)["']\s*\)/g)) {
    const spec = m[1] ?? m[2];
    if (spec.startsWith("./")) graph(spec.slice(2), seen);
    else seen.set(`external:${spec}`, "");
  }
  return seen;
}

test("the core imports no Node module and uses no Node global", () => {
  const files = graph("index.js");
  assert.ok(files.has("box.js") && files.has("events.js") && files.has("socket.js"));
  const external = [...files.keys()].filter((k) => k.startsWith("external:"));
  assert.deepEqual(external, []);
  for (const f of ["node.js", "tokens.js", "agent.js"]) assert.ok(!files.has(f), `${f} is in the core's imports`);
  for (const [f, src] of files) {
    assert.doesNotMatch(src, /(?<![\w./])process\.(?!js)|\bBuffer\b|\brequire\(/, `${f} uses a Node global`);
  }
});

test("the control: the Node entry point does import Node modules", () => {
  const files = graph("node.js");
  assert.ok([...files.keys()].some((k) => k.startsWith("external:node:")));
});
