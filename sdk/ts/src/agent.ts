/** The agent side of the agent channel (docs/architecture.md, "The agent channel"), for an agent
 * written in TypeScript on Node. No dependency beyond Node itself.
 *
 * The supervisor gives the agent a pipe pair instead of the box token: SANDBOXER_CHANNEL_FD
 * names the fd the agent writes requests to and the fd it reads replies from, as `REQ,REPLY`
 * (one number names a single bidirectional fd). Both directions carry JSON lines; replies have
 * the WebSocket API's shape. After a restore or fork, the first line on the reply fd is an
 * identity line with neither `id` nor `ok`, kept in `Channel.identity`.
 *
 * Calls block until the supervisor answers (synchronous reads on the reply fd): a checkpoint
 * then catches the agent between two statements, and a restored copy resumes inside the same
 * call, which returns there with `copy: true`. tests/protocol/channel.json holds the requests
 * and replies this module and the supervisor are both checked against. */
import { readFileSync, readSync, writeSync } from "node:fs";

export type JsonObject = { [k: string]: unknown };

export const BRANCH_JSON = "/run/sandboxer/branch.json";

/** Who this branch is, from its own filesystem (written into each copy before its restore). */
export function branchInfo(path = BRANCH_JSON): JsonObject {
  return JSON.parse(readFileSync(path, "utf8")) as JsonObject;
}

/** A request on the channel failed: `code` and `detail` as the supervisor sent them. */
export class ChannelError extends Error {
  constructor(readonly code: string, readonly detail: string) {
    super(`${code}: ${detail}`);
    this.name = "ChannelError";
  }
}

/** [request fd, reply fd] from a SANDBOXER_CHANNEL_FD value: "N" or "REQ,REPLY". */
export function parseFds(spec: string): [number, number] {
  const parts = spec.replace(/:/g, ",").split(",").map((p) => p.trim());
  const fds = parts.map((p) => (/^[0-9]+$/.test(p) ? Number(p) : NaN));
  if (fds.some((n) => Number.isNaN(n))) {
    throw new ChannelError("bad_channel", `SANDBOXER_CHANNEL_FD=${JSON.stringify(spec)} is not an fd or a pair REQ,REPLY`);
  }
  if (fds.length === 1) return [fds[0]!, fds[0]!];
  if (fds.length === 2) return [fds[0]!, fds[1]!];
  throw new ChannelError("bad_channel", `SANDBOXER_CHANNEL_FD=${JSON.stringify(spec)} names ${fds.length} fds, expected 1 or 2`);
}

const sleeper = new Int32Array(new SharedArrayBuffer(4));

export class Channel {
  private readonly reqFd: number;
  private readonly replyFd: number;
  private buf = Buffer.alloc(0);
  private nextId = 1;
  /** The last identity line (sent after a restore or fork), or null. */
  identity: JsonObject | null = null;

  constructor(spec: string | undefined = process.env.SANDBOXER_CHANNEL_FD) {
    if (!spec) throw new ChannelError("no_channel", "SANDBOXER_CHANNEL_FD is not set: not running under sandboxer");
    [this.reqFd, this.replyFd] = parseFds(spec);
  }

  private readLine(): JsonObject {
    const chunk = Buffer.alloc(65536);
    for (;;) {
      const nl = this.buf.indexOf(10);
      if (nl >= 0) {
        const line = this.buf.subarray(0, nl).toString("utf8");
        this.buf = this.buf.subarray(nl + 1);
        const obj: unknown = JSON.parse(line);
        if (obj === null || typeof obj !== "object" || Array.isArray(obj)) {
          throw new ChannelError("protocol", `channel line is not a JSON object: ${line.slice(0, 200)}`);
        }
        return obj as JsonObject;
      }
      let n: number;
      try {
        n = readSync(this.replyFd, chunk, 0, chunk.length, null);
      } catch (e) {
        // An fd left non-blocking by someone else: wait a little and read again.
        if ((e as NodeJS.ErrnoException).code === "EAGAIN") {
          Atomics.wait(sleeper, 0, 0, 5);
          continue;
        }
        throw e;
      }
      if (n === 0) throw new ChannelError("channel_closed", "the supervisor closed the channel");
      this.buf = Buffer.concat([this.buf, chunk.subarray(0, n)]);
    }
  }

  private writeAll(data: Buffer): void {
    let off = 0;
    while (off < data.length) {
      try {
        off += writeSync(this.reqFd, data, off);
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code !== "EAGAIN") throw e;
        Atomics.wait(sleeper, 0, 0, 5);
      }
    }
  }

  /** Sends one request and returns its reply; throws ChannelError when it is not ok. */
  request(op: string, fields: JsonObject = {}): JsonObject {
    if ("id" in fields) throw new TypeError("a request field cannot be named id: that is the request's own id");
    const id = this.nextId++;
    this.writeAll(Buffer.from(JSON.stringify({ id, op, ...fields }) + "\n"));
    let reply: JsonObject;
    for (;;) {
      reply = this.readLine();
      if (!("id" in reply) && !("ok" in reply)) {
        this.identity = reply;
        continue;
      }
      if (reply.id !== id && reply.id !== null) continue; // a reply to an earlier copy's request
      break;
    }
    if (reply.ok !== true) {
      const err = (reply.error ?? {}) as JsonObject;
      throw new ChannelError(String(err.code ?? "unknown"), String(err.message ?? ""));
    }
    return reply;
  }

  /** Who this copy is: box, branch, parent, snapshot, index, mode. */
  whoami(): JsonObject {
    const { id: _id, ok: _ok, ...rest } = this.request("whoami");
    return rest;
  }

  /** Checkpoints this agent; returns once the checkpoint is taken. In a restored copy the call
   * returns there too, with `copy: true`. With leaveRunning false the original ends once its
   * memory and files are saved. */
  checkpoint(name: string, leaveRunning = true): JsonObject {
    return this.request("checkpoint", { name, leave_running: leaveRunning });
  }

  /** Checkpoints this agent and starts n live copies of it in this box. Returns in the original
   * (`copy: false`, `copies` lists the new branches) and in each copy (`copy: true`, `branch`,
   * `index`). */
  fork(n: number, name = ""): JsonObject {
    return this.request("fork", { n, name });
  }

  /** Restores `snapshot` once more in this box, as a new branch. */
  restore(snapshot: string): JsonObject {
    return this.request("restore", { snapshot });
  }

  /** This box's snapshots. */
  snapshots(): JsonObject[] {
    return this.request("snapshot.list").snapshots as JsonObject[];
  }

  deleteSnapshot(snapshot: string): void {
    this.request("snapshot.delete", { snapshot });
  }

  /** Writes a custom event of `type` with `fields` into the box's journal. */
  event(type: string, fields: JsonObject = {}): JsonObject {
    return this.request("event", { event: { type, ...fields } });
  }
}

let defaultChannel: Channel | null = null;

/** The process-wide channel from SANDBOXER_CHANNEL_FD. */
export function channel(): Channel {
  defaultChannel ??= new Channel();
  return defaultChannel;
}

export const whoami = (): JsonObject => channel().whoami();
export const checkpoint = (name: string): JsonObject => channel().checkpoint(name);
export const fork = (n: number, name = ""): JsonObject => channel().fork(n, name);
export const event = (type: string, fields: JsonObject = {}): JsonObject => channel().event(type, fields);
