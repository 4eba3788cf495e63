// sdk/ts against the real supervisor (sandboxer-init --listen, as PID 1 of a pid namespace):
// auth and token discovery, events with since, resume after lost connections and after 4008,
// exec with stdin and a pty, signals, files in binary frames, stats, typed errors, checkpoint,
// snapshots and fork.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { createServer } from "node:net";
import { AuthError, Box, ConnectionLost, SandboxerError, outputBytes, storeToken, tokenKey, tokenPath } from "../dist/node.js";
import { isOutputWith, PROBE, startBox, startRelay, text, until } from "./helpers.mjs";

const sha = (b) => createHash("sha256").update(b).digest("hex");
// An archive's snapshot id: the sha256 of its first tar entry, manifest.json (format 3).
function archiveId(archive) {
  const tar = execFileSync("zstd", ["-d", "-q", "-c"], { input: archive, maxBuffer: 1 << 30 });
  const name = tar.subarray(0, 100).toString().replace(/\0.*$/s, "");
  assert.equal(name, "manifest.json");
  const size = parseInt(tar.subarray(124, 136).toString(), 8);
  return "s-" + sha(tar.subarray(512, 512 + size)).slice(0, 16);
}

async function rejects(p) {
  try {
    await p;
  } catch (e) {
    return e;
  }
  assert.fail("expected a rejection");
}

function withEnv(vars, fn) {
  const old = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
  Object.assign(process.env, vars);
  return fn().finally(() => {
    for (const [k, v] of Object.entries(old)) v === undefined ? delete process.env[k] : (process.env[k] = v);
  });
}

describe("one box", () => {
  let server;
  let box;
  before(async () => {
    server = await startBox();
    box = await Box.connect(server.url, { token: server.token });
  });
  after(async () => {
    await box?.close();
    await server.stop();
  });

  // -- auth and tokens ---------------------------------------------------------------------

  test("a wrong token is refused with AuthError (header and auth frame) and the box keeps serving", async () => {
    const e1 = await rejects(Box.connect(server.url, { token: "not-the-token" }));
    assert.ok(e1 instanceof AuthError && e1.code === "unauthorized", String(e1));
    const e2 = await rejects(Box.connect(server.url, { token: "not-the-token", authFrame: true }));
    assert.ok(e2 instanceof AuthError, String(e2));
    assert.ok(server.alive());
    const ok = await Box.connect(server.url, { token: server.token, authFrame: true });
    assert.equal(typeof (await ok.stats()).box, "object");
    await ok.close();
  });

  test("the token comes from SANDBOXER_TOKEN, then from the CLI's per-URL store", async () => {
    await withEnv({ SANDBOXER_TOKEN: server.token }, async () => {
      const b = await Box.connect(server.url);
      await b.stats();
      await b.close();
    });
    const state = mkdtempSync(join(tmpdir(), "sbx-ts-state-"));
    try {
      await withEnv({ XDG_STATE_HOME: state, SANDBOXER_TOKEN: "" }, async () => {
        const missing = await rejects(Box.connect(server.url));
        assert.ok(missing instanceof AuthError && missing.message.includes(tokenPath(server.url)), missing.message);
        const p = storeToken(server.url + "/", server.token);
        assert.equal(statSync(p).mode & 0o777, 0o600);
        assert.equal(readFileSync(p, "utf8"), server.token + "\n");
        const b = await Box.connect(server.url);
        await b.stats();
        await b.close();
      });
    } finally {
      rmSync(state, { recursive: true, force: true });
    }
    assert.equal(tokenKey("ws://127.0.0.1:7000/"), "ws%3A%2F%2F127.0.0.1%3A7000");
    assert.equal(tokenKey("WS://Host:1/a/#x"), "ws%3A%2F%2Fhost%3A1%2Fa");
  });

  test("with no token found where nothing answers (a box that ended), that is what is said", async () => {
    // A port that was free a moment ago; the control, the same with the box's URL, is the
    // AuthError of the test above.
    const srv = createServer();
    await new Promise((r) => srv.listen(0, "127.0.0.1", r));
    const port = srv.address().port;
    await new Promise((r) => srv.close(r));
    const state = mkdtempSync(join(tmpdir(), "sbx-ts-state-"));
    try {
      await withEnv({ XDG_STATE_HOME: state, SANDBOXER_TOKEN: "" }, async () => {
        const e = await rejects(Box.connect(`ws://127.0.0.1:${port}`));
        assert.ok(e instanceof ConnectionLost, String(e));
        assert.ok(e.message.includes(`; and no box answers at ws://127.0.0.1:${port}: Connection refused (nothing listens on 127.0.0.1:${port})`), e.message);
      });
    } finally {
      rmSync(state, { recursive: true, force: true });
    }
  });

  test("a URL that is not ws:// or wss:// is refused, naming it", async () => {
    const e = await rejects(Box.connect("http://127.0.0.1:1", { token: "t" }));
    assert.ok(e instanceof TypeError && e.message.includes("http://127.0.0.1:1"));
  });

  // -- events ------------------------------------------------------------------------------

  test("events since N start right after N", async () => {
    const everything = await until(box.events({ since: 0 }), isOutputWith("ready"));
    assert.deepEqual(everything.map((e) => e.seq), everything.map((_, i) => i + 1));
    assert.equal(everything[0].type, "box.started");
    const n = everything[1].seq;
    const last = everything.at(-1).seq;
    const later = await until(box.events({ since: n }), (e) => e.seq === last);
    assert.deepEqual(later, everything.filter((e) => e.seq > n));
  });

  // -- processes ---------------------------------------------------------------------------

  test("exec streams stdout and stderr and resolves with the exit code", async () => {
    const p = await box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], { proc: "p1" });
    const ex = await p.wait(20_000);
    assert.deepEqual([ex.code, ex.reason], [3, "exited"]);
    assert.equal(text(p.stdout), "out\n");
    assert.equal(text(p.stderr), "err\n");
    assert.equal(p.events[0].type, "proc.started");
    const again = await box.exec(["sh", "-c", "echo twice"], { proc: "p1" });
    await again.wait(10_000);
    assert.equal(again.reply.existing, true);
    assert.equal(text(again.stdout), "out\n");
  });

  test("output can be read as it streams", async () => {
    const p = await box.exec(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.05; done"]);
    const chunks = [];
    for await (const [stream, data] of p.output()) chunks.push([stream, text(data)]);
    assert.equal(chunks.filter(([s]) => s === "stdout").map(([, d]) => d).join(""), "1\n2\n3\n");
    assert.equal((await p.wait(10_000)).code, 0);
  });

  test("stdin data, binary too, then EOF reach the process", async () => {
    const payload = Buffer.from("hello\n\xff\xfe binary \x00 bytes\n", "latin1");
    const p = await box.exec(["sh", "-c", "cat; echo; echo eof-seen"], { stdin: true });
    await p.write(payload.subarray(0, 6));
    await p.write(new Uint8Array(payload.subarray(6)));
    await p.closeStdin();
    assert.equal((await p.wait(10_000)).code, 0);
    assert.equal(Buffer.from(p.stdout).toString("latin1"), payload.toString("latin1") + "\neof-seen\n");
  });

  test("exec's words, env values and cwd may be bytes that are not UTF-8", async () => {
    const bytes = (s) => new Uint8Array(Buffer.from(s, "latin1"));
    const mk = await box.exec(["mkdir", "-p", bytes("/tmp/ts\xe9")]);
    assert.equal((await mk.wait(10_000)).code, 0);
    const p = await box.exec(["sh", "-c", 'printf "%s|%s|" "$1" "$V"; pwd', "sh", bytes("w\xff")], {
      env: { V: bytes("\xfe"), U: "text" },
      cwd: bytes("/tmp/ts\xe9"),
    });
    assert.equal((await p.wait(10_000)).code, 0);
    assert.equal(Buffer.from(p.stdout).toString("latin1"), "w\xff|\xfe|/tmp/ts\xe9\n");
    const rm = await box.exec(["rmdir", bytes("/tmp/ts\xe9")]);
    assert.equal((await rm.wait(10_000)).code, 0);
  });

  test("a pty: the process sees a terminal of the size asked for, and input typed into it", async () => {
    const p = await box.exec(["sh", "-c", "test -t 0 && test -t 1 && stty size && read line && echo got-$line"], { tty: true, cols: 91, rows: 37 });
    await p.write("typed\n");
    const ex = await p.wait(10_000);
    assert.equal(ex.code, 0, text(p.pty));
    assert.match(text(p.pty), /37 91/);
    assert.match(text(p.pty), /got-typed/);
  });

  test("a signal by name ends the process", async () => {
    const p = await box.exec([PROBE, "wait"]);
    for await (const [, data] of p.output()) if (text(data).includes("ready")) break;
    await p.signal("TERM");
    assert.equal((await p.wait(10_000)).signal, "TERM");
  });

  test("exec of a missing program rejects with spawn_failed naming it", async () => {
    const e = await rejects(box.exec(["/no/such/program"], { proc: "ghost" }));
    assert.ok(e instanceof SandboxerError && e.code === "spawn_failed" && e.message.includes("/no/such/program"), String(e));
    assert.equal(e.reply.state.proc, "ghost");
  });

  // -- files -------------------------------------------------------------------------------

  test("a file of several megabytes round-trips in binary frames, every byte kept", async () => {
    const data = new Uint8Array(randomBytes(5 * 1024 * 1024 + 12345));
    await box.fs.write("/workspace/blob.bin", data);
    assert.equal(sha(readFileSync(join(server.workspace, "blob.bin"))), sha(data)); // what the box holds
    const back = await box.fs.read("/workspace/blob.bin");
    assert.equal(sha(back), sha(data));
    assert.equal((await box.fs.stat("/workspace/blob.bin")).size, data.length);
    assert.ok((await box.fs.list("/workspace")).some((e) => e.name === "blob.bin"));
    const range = await box.fs.read("/workspace/blob.bin", { offset: 1_048_570, length: 20 });
    assert.equal(sha(range), sha(data.subarray(1_048_570, 1_048_590)));
  });

  test("an atomic write replaces the file whole: a new inode, the old mode; a refused one leaves it", async () => {
    await box.fs.write("/workspace/conf.json", "{}");
    await box.fs.chmod("/workspace/conf.json", 0o600);
    const before = statSync(join(server.workspace, "conf.json")).ino;
    const big = new Uint8Array(randomBytes(3 * 1024 * 1024));
    await box.fs.write("/workspace/conf.json", big, { atomic: true });
    const after = statSync(join(server.workspace, "conf.json"));
    assert.notEqual(after.ino, before); // renamed over it, not written through it
    assert.equal(after.mode & 0o777, 0o600);
    assert.equal(sha(readFileSync(join(server.workspace, "conf.json"))), sha(big));
    const e = await rejects(box.fs.write("/workspace/conf.json", "x", { atomic: true, append: true }));
    assert.ok(e instanceof SandboxerError && e.code === "bad_request", String(e));
    assert.equal(sha(readFileSync(join(server.workspace, "conf.json"))), sha(big));
    assert.deepEqual(readdirSync(server.workspace).filter((n) => n.startsWith(".sbx-write-")), []);
  });

  test("empty and small binary files, mkdir, rename and remove", async () => {
    await box.fs.mkdir("/workspace/d");
    await box.fs.write("/workspace/d/empty", new Uint8Array(0), { inline: false });
    assert.equal((await box.fs.read("/workspace/d/empty")).length, 0);
    await box.fs.write("/workspace/d/bin", new Uint8Array([0xff, 0, 0xfe]));
    assert.deepEqual([...(await box.fs.read("/workspace/d/bin"))], [0xff, 0, 0xfe]);
    await box.fs.write("/workspace/d/other", "old");
    const kept = await rejects(box.fs.rename("/workspace/d/bin", "/workspace/d/other"));
    assert.ok(kept instanceof SandboxerError && kept.code === "exists", String(kept));
    assert.equal(new TextDecoder().decode(await box.fs.read("/workspace/d/other")), "old");
    await box.fs.rename("/workspace/d/bin", "/workspace/d/other", { replace: true });
    assert.deepEqual([...(await box.fs.read("/workspace/d/other"))], [0xff, 0, 0xfe]);
    assert.deepEqual((await box.fs.list("/workspace/d")).map((x) => x.name).sort(), ["empty", "other"]);
    const e = await rejects(box.fs.remove("/workspace/d"));
    assert.ok(e instanceof SandboxerError && e.message.includes("/workspace/d"), String(e));
    await box.fs.remove("/workspace/d", { recursive: true });
    const gone = await rejects(box.fs.stat("/workspace/d/bin"));
    assert.ok(gone instanceof SandboxerError && gone.code !== "protocol", String(gone));
  });

  test("list asks a page at a time (10,000 entries) and gives every entry once, in byte order", async () => {
    const dir = join(server.workspace, "paged");
    mkdirSync(dir);
    const names = [];
    for (let i = 0; i < 10002; i++) names.push(Buffer.from(`n${String(i).padStart(5, "0")}`));
    names.push(Buffer.from([0x6e, 0x30, 0x39, 0x39, 0x39, 0x39, 0xff])); // "n09999\xff": not UTF-8
    for (const n of names) writeFileSync(Buffer.concat([Buffer.from(dir + "/"), n]), "x");
    const listed = await box.fs.list("/workspace/paged");
    const got = listed.map((e) => (e.name_b64 ? Buffer.from(e.name_b64, "base64") : Buffer.from(e.name)));
    assert.deepEqual(got.map((b) => b.toString("hex")), names.sort(Buffer.compare).map((b) => b.toString("hex")));
    const page = await box.fs.listPage("/workspace/paged", { limit: 2, after: "n09998" });
    assert.equal(page.more, true);
    assert.deepEqual(page.entries.map((e) => e.name_b64 ?? e.name), ["n09999", Buffer.from("n09999\xff", "latin1").toString("base64")]);
    rmSync(dir, { recursive: true });
  });

  test("symlink, chmod and a directory's mode", async () => {
    await box.fs.write("/workspace/sc", "x");
    await box.fs.symlink("/workspace/sc-link", "sc");
    await box.fs.mkdir("/workspace/sc-dir", { mode: 0o750 });
    await box.fs.chmod("/workspace/sc", 0o600);
    const e = await rejects(box.fs.symlink("/workspace/sc-link", "elsewhere"));
    assert.ok(e instanceof SandboxerError && e.code === "exists" && e.message.includes("/workspace/sc-link"), String(e));
    const entries = Object.fromEntries((await box.fs.list("/workspace")).map((x) => [x.name, x]));
    assert.equal(entries["sc-link"].type, "symlink");
    assert.equal(entries["sc-link"].target, "sc");
    assert.equal(entries["sc-dir"].mode, 0o750);
    assert.equal(entries["sc"].mode, 0o600);
    assert.equal(new TextDecoder().decode(await box.fs.read("/workspace/sc-link")), "x");
  });

  test("a path that escapes the box is refused with a typed error", async () => {
    const e = await rejects(box.fs.read("/etc/shadow"));
    assert.ok(e instanceof SandboxerError && e.code && e.message.includes("/etc/shadow"), String(e));
  });

  // -- the box -----------------------------------------------------------------------------

  test("stats report the box and its processes; an unknown op is a typed error", async () => {
    const st = await box.stats();
    assert.equal(typeof st.box.memory, "number");
    assert.ok(st.procs);
    const e = await rejects(box.request("launch_missiles"));
    assert.ok(e instanceof SandboxerError && e.code === "unknown_op", String(e));
    const e2 = await rejects(box.request("exec", { proc: "x", argv: "not-a-list" }));
    assert.ok(e2.message.includes("argv"), e2.message);
    assert.match((await rejects(box.request("stats", { id: 5 }))).message, /id or op/);
    await box.stats();
  });

  test("checkpoint, snapshots, fork into live branches, export and import, delete", async () => {
    const cp = await box.checkpoint("ts-test");
    const sid = cp.snapshot;
    assert.match(sid, /^s-[0-9a-f]{16}$/);
    assert.ok((await box.snapshots()).some((s) => s.id === sid));
    const forked = await box.fork(sid, 2);
    const copies = forked.copies ?? forked.branches;
    assert.equal(copies.length, 2, JSON.stringify(forked));
    const branch = copies[0].branch ?? copies[0];
    // The copy is a live branch of the box: a process runs in it.
    const p = await box.exec(["sh", "-c", "echo in-copy"], { branch });
    assert.equal((await p.wait(20_000)).code, 0);
    assert.equal(p.branch, branch);
    assert.equal(text(p.stdout), "in-copy\n");
    const archive = await box.exportSnapshot(sid);
    assert.equal(archiveId(archive), sid);
    await box.deleteSnapshot(sid);
    assert.ok(!(await box.snapshots()).some((s) => s.id === sid));
    const back = await box.importSnapshot(archive);
    assert.equal(back.snapshot, sid);
    const bad = await rejects(box.importSnapshot(archive.subarray(0, archive.length >> 1)));
    assert.equal(bad.code, "bad_snapshot");
    // A delta against a snapshot the box has: only what that one lacks, and the same snapshot back.
    const later = (await box.checkpoint("later")).snapshot;
    const delta = await box.exportSnapshot(later, sid);
    assert.equal(new TextDecoder().decode(delta.subarray(0, 8)), "SBXDELTA");
    assert.ok(delta.length < (await box.exportSnapshot(later)).length);
    await box.deleteSnapshot(later);
    const again = await box.importSnapshot(delta);
    assert.equal(again.snapshot, later);
    assert.equal(again.base, sid);
    const e = await rejects(box.restore("s-0000000000000000"));
    assert.ok(e instanceof SandboxerError && e.code !== "unknown_op" && e.detail, String(e));
  });
});

// The supervisor reads output in large chunks, so a loaded machine joins lines into fewer events:
// 600 lines over ~3 s still give more events than the last cut, and the cuts are far enough
// apart that events buffered before one cut do not reach the next.
const SPEW = ["python3", "-c", "import time\nfor i in range(600):\n    print('line', i, flush=True)\n    time.sleep(0.005)\nprint('DONE', flush=True)\ntime.sleep(1000)\n"];
const CUTS = [3, 30, 80, 150];

test("after lost connections the stream is the uninterrupted sequence: no gap, no duplicate", async () => {
  const server = await startBox(SPEW);
  const relay = await startRelay(server.port);
  try {
    const direct = await Box.connect(server.url, { token: server.token });
    const relayed = await Box.connect(relay.url, { token: server.token });
    const uninterrupted = until(direct.events({ since: 0 }), isOutputWith("DONE"));
    const interrupted = (async () => {
      const got = [];
      const s = relayed.events({ since: 0 });
      for await (const ev of s) {
        got.push(ev);
        if (CUTS.includes(got.length)) relay.cut(); // the network drops mid-stream, no close frame
        if (isOutputWith("DONE")(ev)) break;
      }
      return [got, s.reconnects, s.closes];
    })();
    const [a, [b, reconnects, closes]] = await Promise.all([uninterrupted, interrupted]);
    assert.equal(relay.cuts, CUTS.length);
    assert.equal(reconnects, CUTS.length);
    assert.ok(closes.every((c) => c.code === null), JSON.stringify(closes));
    assert.ok(a.length > CUTS.at(-1));
    assert.deepEqual(a.map((e) => e.seq), a.map((_, i) => i + 1));
    assert.deepEqual(b, a);
    await direct.close();
    await relayed.close();
  } finally {
    await relay.close();
    await server.stop();
  }
});

test("a reader that takes nothing for the stall time is closed with 4008 and resumes with every seq", async () => {
  // A reader that falls behind is served from the journal; only one that takes nothing for the
  // stall time (1 s here, 30 s by default) is closed. This one stops reading the socket once 64
  // frames wait in the SDK, so it takes nothing while the test sleeps.
  const server = await startBox(undefined, [], { SANDBOXER_WS_STALL_SECONDS: "1" });
  try {
    const box = await Box.connect(server.url, { token: server.token });
    const s = box.events({ since: 0 });
    const got = await until(s, isOutputWith("ready")); // caught up: the stream is live
    // 48 MB of output while this reader does not read: far more than the server queues for it.
    const p = await box.exec([PROBE, "spew", "48000000"], { proc: "spew" });
    await new Promise((r) => setTimeout(r, 4000));
    for await (const ev of s) {
      got.push(ev);
      if (ev.type === "proc.exited" && ev.proc === "spew") break;
    }
    assert.ok(s.closes.some((c) => c.code === 4008 && c.reason.startsWith("resume_after=")), JSON.stringify(s.closes));
    assert.deepEqual(got.map((e) => e.seq), got.map((_, i) => i + 1));
    assert.equal((await p.wait(30_000)).code, 0);
    let bytes = 0;
    for (const e of got) if (e.proc === "spew" && e.type === "proc.output") bytes += outputBytes(e).length;
    assert.equal(bytes, 48_000_000);
    await box.close();
  } finally {
    await server.stop();
  }
});

test("the event stream ends when the box shuts down", async () => {
  const server = await startBox();
  try {
    const box = await Box.connect(server.url, { token: server.token });
    const s = box.events({ since: 0 });
    await until(s, isOutputWith("ready"));
    await box.shutdown(1);
    const rest = [];
    for await (const ev of s) rest.push(ev);
    const exits = rest.filter((e) => e.type === "proc.exited");
    assert.equal(exits.length, 1, JSON.stringify(rest.map((e) => [e.type, e.reason])));
    assert.equal(exits.at(-1)?.reason, "shutdown");
    await box.close();
  } finally {
    await server.stop();
  }
});
