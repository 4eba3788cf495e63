// sdk/ts against the shared protocol vectors (tests/protocol/): binary headers, close codes, how
// frames are told apart, error replies; the agent channel (channel.json) as the agent module
// speaks it; and, against the real supervisor, that each request the SDK sends is the vector's
// request and each refused one rejects with the vector's code.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { after, before, describe, test } from "node:test";
import {
  Box, SandboxerError, classify, decodeChunk, encodeChunk, outputBytes, parseResumeAfter, CLOSE_AUTH, CLOSE_SLOW, wsFactory,
} from "../dist/node.js";
import { load, startBox } from "./helpers.mjs";

const hex = (b) => Buffer.from(b).toString("hex");

describe("vectors without a server", () => {
  for (const v of load("binary.json")) {
    test(`binary header: ${v.name}`, () => {
      const frame = Buffer.from(v.hex + v.data_hex, "hex");
      const c = decodeChunk(new Uint8Array(frame));
      assert.deepEqual([c.requestId, c.offset, c.flags, c.last], [v.id, v.offset, v.flags, v.last]);
      assert.equal(hex(c.data), v.data_hex);
      assert.equal(hex(encodeChunk(v.id, v.offset, c.data, v.last, v.flags)), v.hex + v.data_hex);
    });
  }

  test("a binary frame shorter than its header is refused, naming its size", () => {
    assert.throws(() => decodeChunk(new Uint8Array(12)), /12 bytes is shorter than the 13-byte header/);
  });

  test("close codes", () => {
    const codes = Object.fromEntries(load("close.json").map((v) => [v.code, v]));
    assert.ok(codes[CLOSE_AUTH] && codes[CLOSE_SLOW]);
    assert.equal(parseResumeAfter(codes[CLOSE_SLOW].reason_example), 1234);
    assert.equal(parseResumeAfter("resume_after=x"), null);
  });

  for (const v of load("events.json")) {
    test(`event: ${v.name}`, () => {
      assert.equal(classify(v.frame), "event");
      if (v.frame.type === "proc.output" && v.bytes_hex) assert.equal(hex(outputBytes(v.frame)), v.bytes_hex);
    });
  }

  for (const v of load("replies.json")) {
    test(`reply: ${v.name}`, () => {
      assert.equal(classify(v.frame), "reply");
      if (!v.frame.ok) {
        const e = SandboxerError.fromReply(v.frame, "op");
        assert.deepEqual([e.code, e.detail], [v.frame.error.code, v.frame.error.message]);
        assert.deepEqual(e.reply, v.frame);
      }
    });
  }
});

/** Runs test/channel-runner.mjs as the agent, this process playing the supervisor: reads one
 * request line and answers with `answer(request)`'s lines. */
function channelCall(call, answer) {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [new URL("./channel-runner.mjs", import.meta.url).pathname, call], {
      env: { ...process.env, SANDBOXER_CHANNEL_FD: "3,4" },
      stdio: ["ignore", "pipe", "inherit", "pipe", "pipe"],
    });
    let out = "";
    let buf = "";
    let seen = null;
    child.stdout.on("data", (d) => (out += d));
    child.stdio[3].on("data", (d) => {
      buf += d;
      const nl = buf.indexOf("\n");
      if (nl < 0 || seen) return;
      seen = JSON.parse(buf.slice(0, nl));
      for (const line of answer(seen)) child.stdio[4].write(JSON.stringify(line) + "\n");
    });
    child.on("error", reject);
    child.on("exit", (code) => (code === 0 ? resolve({ seen, out: JSON.parse(out) }) : reject(new Error(`runner exited ${code}`))));
  });
}

describe("the agent channel (channel.json)", () => {
  const ch = load("channel.json");
  const calls = new Set(["whoami", "checkpoint", "checkpoint that ends the original", "event",
    "event with a bare type and the journal's fields", "fork", "restore", "snapshot.list", "snapshot.delete"]);

  test("every valid channel vector but the string id is mapped to its call", () => {
    const names = ch.requests.filter((v) => v.valid).map((v) => v.name).filter((n) => n !== "a string id");
    assert.deepEqual(names.sort(), [...calls].sort());
  });

  for (const v of ch.requests.filter((v) => calls.has(v.name))) {
    test(`request: ${v.name}`, async () => {
      const { seen } = await channelCall(v.name, (r) => [{ id: r.id, ok: true, snapshots: [] }]);
      const want = JSON.parse(v.text);
      delete want.id;
      assert.ok(Number.isInteger(seen.id));
      delete seen.id;
      assert.deepEqual(seen, want);
    });
  }

  for (const v of ch.replies) {
    test(`reply: ${v.name}`, async () => {
      const f = v.frame;
      const { out } = await channelCall("raw whoami", (r) => [{ ...f, id: f.id !== null ? r.id : null }]);
      if (f.ok) assert.deepEqual(out.reply, { ...f, id: 1 });
      else assert.deepEqual(out.error, { code: f.error.code, detail: f.error.message });
    });
  }

  for (const v of ch.identity) {
    test(`identity: ${v.name}`, async () => {
      const { out } = await channelCall("snapshot.list", (r) => [v.frame, { id: r.id, ok: true, snapshots: [] }]);
      assert.deepEqual(out.reply, []);
      assert.deepEqual(out.identity, v.frame);
    });
  }
});

// Fields whose absence means the same as this value; a vector may spell them out or not.
const DEFAULTS = { tty: false, stdin: false, eof: false, recursive: false, append: false };
function normalized(text) {
  const o = JSON.parse(text);
  delete o.id;
  for (const [k, v] of Object.entries(DEFAULTS)) if (o[k] === v) delete o[k];
  return o;
}

async function quietly(p) {
  try {
    await Promise.race([p, new Promise((r) => setTimeout(r, 5000))]);
  } catch (e) {
    if (!(e instanceof SandboxerError)) throw e;
  }
}

async function firstEvent(stream) {
  await Promise.race([stream.next(), new Promise((r) => setTimeout(r, 2000))]);
  stream.close();
}

const CALLS = {
  "subscribe from the start": (b) => firstEvent(b.events({ since: 0 })),
  "subscribe to a branch": (b) => firstEvent(b.events({ since: 41, branch: "main" })),
  "exec with pipes": (b) => b.exec(["sh", "-c", "echo hi"], { proc: "p1", env: { A: "1" }, cwd: "/workspace", stdin: true }),
  "exec with a pty": (b) => b.exec(["sh"], { proc: "shell", tty: true, cols: 120, rows: 40 }),
  "exec of names that are not UTF-8": (b) =>
    b.exec(["ls", new Uint8Array([...new TextEncoder().encode("/workspace/caf"), 0xe9])], {
      proc: "p2",
      env: { A: new Uint8Array([0xff]) },
      cwd: new Uint8Array([...new TextEncoder().encode("/workspace/caf"), 0xe9]),
    }),
  "stdin text": (b) => b.stdin("p1", "hello\n"),
  "stdin bytes and eof": (b) => b.stdin("p1", new Uint8Array([0xff]), { eof: true }),
  "signal by name": (b) => b.signal("p1", "TERM"),
  "signal by number": (b) => b.signal("p1", 15),
  "resize": (b) => b.resize("shell", 100, 30),
  "fs.read": (b) => b.fs.read("/workspace/a.txt"),
  "fs.write with binary frames": (b) => b.fs.write("/workspace/a.txt", "hello", { inline: false }),
  "fs.write inline": (b) => b.fs.write("b.txt", "small"),
  "fs.write atomic": (b) => b.fs.write("/workspace/c.json", "hello", { atomic: true, inline: false }),
  "fs.list": (b) => b.fs.list("/workspace"),
  "fs.list, a page": (b) => b.fs.listPage("/workspace", { limit: 2, after: "a.txt" }),
  "fs.list whole": (b) => b.request("fs.list", { path: "/workspace" }), // what an older SDK sent
  "fs.stat": (b) => b.fs.stat("/workspace/a.txt"),
  "fs.stat not followed": (b) => b.fs.stat("/workspace/link", { follow: false }),
  "fs.stat of a name that is not UTF-8": (b) =>
    b.fs.stat(new Uint8Array([...new TextEncoder().encode("/workspace/caf"), 0xe9])),
  "fs.remove": (b) => b.fs.remove("/workspace/a.txt"),
  "fs.rename": (b) => b.fs.rename("/workspace/a.txt", "/workspace/b.txt"),
  "fs.mkdir with a mode": (b) => b.fs.mkdir("/workspace/d", { mode: 0o750 }),
  "fs.symlink": (b) => b.fs.symlink("/workspace/link", "a.txt"),
  "fs.symlink with bytes that are not UTF-8": (b) => b.fs.symlink("/workspace/latin", new Uint8Array([0x63, 0x61, 0x66, 0xe9])),
  "fs.chmod": (b) => b.fs.chmod("/workspace/a.txt", 0o600),
  "stats": (b) => b.stats(),
  "string id": (b) => b.request("ping"),
  "shutdown": (b) => b.shutdown("2s"),
};

/** The `ws` package's WebSockets, every text frame sent kept in `sent`. */
function spyingFactory(sent) {
  const f = wsFactory();
  return {
    headers: true,
    open(...args) {
      const ws = f.open(...args);
      const send = ws.send.bind(ws);
      ws.send = (d, ...rest) => {
        if (typeof d === "string") sent.push(d);
        return send(d, ...rest);
      };
      return ws;
    },
  };
}

/** An invalid vector the SDK can send through Box.request (a JSON object with a string op and a
 * small integer id: the SDK picks its own ids), whose refusal is not about the id. */
function expressible(v) {
  let o;
  try {
    o = JSON.parse(v.text);
  } catch {
    return false;
  }
  return o !== null && typeof o === "object" && !Array.isArray(o) && typeof o.op === "string" && Number.isInteger(o.id) &&
    o.id < 2 ** 31 && v.id !== null && v.id !== undefined && !/\bid\b/.test(v.name);
}

describe("vectors against the real supervisor", () => {
  let server;
  before(async () => (server = await startBox()));
  after(() => server.stop());

  test("every valid request vector is what the SDK sends", async () => {
    const vectors = load("requests.json").filter((v) => v.valid);
    const sent = [];
    const webSocket = spyingFactory(sent);
    const mismatches = [];
    const b0 = await Box.connect(server.url, { token: server.token, authFrame: true, webSocket });
    await b0.close();
    const auth = sent.map((t) => JSON.parse(t)).find((o) => o.op === "auth");
    const want = normalized(vectors.find((v) => v.name === "auth").text.replace('"T"', JSON.stringify(server.token)));
    assert.deepEqual(auth, want);
    const box = await Box.connect(server.url, { token: server.token, webSocket });
    const ordered = [...vectors].sort((a, b) => (a.safe === false) - (b.safe === false)); // shutdown last
    for (const v of ordered) {
      if (v.name === "auth") continue;
      assert.ok(CALLS[v.name], `no SDK call for vector ${v.name}`);
      sent.length = 0;
      await quietly(CALLS[v.name](box));
      const w = normalized(v.text);
      const got = sent.map(normalized).filter((o) => o.op === w.op);
      if (!got.some((g) => JSON.stringify(g) === JSON.stringify(w) || isDeepEqual(g, w))) mismatches.push([v.name, got]);
    }
    await box.close();
    assert.deepEqual(mismatches, []);
  });
});

describe("refused vectors against the real supervisor", () => {
  let server;
  before(async () => (server = await startBox()));
  after(() => server.stop());

  test("every refused request vector rejects with its code and the server keeps serving", async () => {
    const vectors = load("requests.json").filter((v) => !v.valid && expressible(v));
    assert.ok(vectors.length >= 15, `only ${vectors.length} vectors`);
    const wrong = [];
    const box = await Box.connect(server.url, { token: server.token });
    for (const v of vectors) {
      const { id: _id, op, ...fields } = JSON.parse(v.text);
      try {
        await box.request(op, fields);
        wrong.push([v.name, "accepted"]);
      } catch (e) {
        if (!(e instanceof SandboxerError) || e.code !== v.code || !e.detail) wrong.push([v.name, e.code, e.message]);
      }
    }
    await box.stats();
    await box.close();
    assert.deepEqual(wrong, []);
    assert.ok(server.alive());
  });
});

function isDeepEqual(a, b) {
  try {
    assert.deepEqual(a, b);
    return true;
  } catch {
    return false;
  }
}
