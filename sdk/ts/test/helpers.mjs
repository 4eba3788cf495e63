// Test helpers: a real sandboxer-init serving on loopback (as tests/sbxtest.py's WsBox starts
// one), the shared protocol vectors, and a TCP relay that can cut or stall connections.
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync, existsSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");
export const BIN = join(process.env.SANDBOXER_BUILD ?? join(ROOT, "build"), "bin");
export const INIT = join(BIN, "sandboxer-init");
export const PROBE = join(BIN, "sbx-testprobe");
export const VECTORS = join(ROOT, "tests", "protocol");

export function load(name) {
  return JSON.parse(readFileSync(join(VECTORS, name), "utf8"));
}

export function readEvents(path) {
  if (!existsSync(path)) return [];
  return readFileSync(path, "utf8")
    .split("\n")
    .filter((l) => l.trim())
    .flatMap((l) => {
      try {
        return [JSON.parse(l)];
      } catch {
        return []; // a line still being written
      }
    });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** sandboxer-init as PID 1 of a fresh pid namespace, running `argv` as its agent and serving
 * ws://127.0.0.1:PORT with a fresh token; `env` is added to its environment. */
export async function startBox(argv = [PROBE, "wait"], extra = [], env = {}) {
  const dir = mkdtempSync(join(tmpdir(), "sbx-ts-"));
  const token = randomBytes(16).toString("hex");
  const tokenFile = join(dir, "token");
  writeFileSync(tokenFile, token + "\n", { mode: 0o600 });
  const events = join(dir, "events.jsonl");
  const cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", INIT, "--state-dir", join(dir, "state"),
    "--events", events, "--listen", "127.0.0.1:0", "--token-file", tokenFile, "--log-level", "warn", ...extra, "--", ...argv];
  let stderr = "";
  // As PID 1 it writes its health file: in the box's temporary dir, not the host's /run.
  const healthFile = { SANDBOXER_HEALTH_FILE: join(dir, "init.json") };
  const child = spawn(cmd[0], cmd.slice(1), {
    detached: true, stdio: ["ignore", "ignore", "pipe"], env: { ...process.env, ...healthFile, ...env },
  });
  child.stderr.on("data", (d) => (stderr = (stderr + d).slice(-4000)));
  const exited = new Promise((r) => child.on("exit", (code, sig) => r(code ?? sig)));
  let port = 0;
  for (let i = 0; i < 750 && !port; i++) {
    port = readEvents(events).find((e) => e.type === "server.listening")?.port ?? 0;
    if (!port) {
      if (child.exitCode !== null) throw new Error(`sandboxer-init exited ${child.exitCode}: ${stderr}`);
      await sleep(20);
    }
  }
  if (!port) throw new Error(`no server.listening event: ${stderr}`);
  return {
    dir, token, tokenFile, port, events, child, exited,
    url: `ws://127.0.0.1:${port}`,
    workspace: join(dir, "state", "branches", "main", "workspace"),
    alive: () => child.exitCode === null && child.signalCode === null,
    stderr: () => stderr,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) {
        try { process.kill(-child.pid, "SIGTERM"); } catch {}
        const t = setTimeout(() => { try { process.kill(-child.pid, "SIGKILL"); } catch {} }, 20000);
        await exited;
        clearTimeout(t);
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** A TCP relay 127.0.0.1:port -> target. `cut()` aborts every connection (a lost network, no
 * close frame). */
export async function startRelay(targetPort) {
  const conns = new Set();
  const server = net.createServer((c) => {
    const s = net.connect(targetPort, "127.0.0.1");
    conns.add(c).add(s);
    c.pipe(s);
    s.pipe(c);
    const end = () => { c.destroy(); s.destroy(); conns.delete(c); conns.delete(s); };
    c.on("error", end).on("close", end);
    s.on("error", end).on("close", end);
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const relay = {
    port: server.address().port,
    cuts: 0,
    get url() { return `ws://127.0.0.1:${this.port}`; },
    cut() {
      relay.cuts++;
      for (const c of conns) c.resetAndDestroy ? c.resetAndDestroy() : c.destroy();
      conns.clear();
    },
    close() { relay.cut(); return new Promise((r) => server.close(r)); },
  };
  return relay;
}

export const text = (b) => new TextDecoder().decode(b);
export const isOutputWith = (s) => (ev) => ev.type === "proc.output" && (ev.data ?? "").includes(s);

/** Events of `stream` up to and including the first that matches `pred`. It reads with next()
 * so the stream stays open (leaving a `for await` loop closes it). */
export async function until(stream, pred) {
  const got = [];
  for (;;) {
    const r = await stream.next();
    if (r.done) return got;
    got.push(r.value);
    if (pred(r.value)) return got;
  }
}
