/** `Box`: a client of one sandboxer box over the sandboxer.v1 WebSocket protocol. Browser-safe:
 * what only Node has (token discovery, the `ws` package) is plugged in by node.ts. */
import { body, Connection, replyArray } from "./connection.js";
import { AuthError, ConnectionLost, type JsonObject } from "./errors.js";
import { EventStream, type EventsOptions } from "./events.js";
import { FileSystem, Receiver } from "./fs.js";
import { Process } from "./process.js";
import { envTextOrB64, iterChunks, listTextOrB64, textOrB64, type Event } from "./protocol.js";
import { checkUrl, globalWebSocketFactory, Socket, type WebSocketFactory } from "./socket.js";

export interface ConnectOptions {
  /** The box token. In Node, when absent: `tokenFile`, then $SANDBOXER_TOKEN, then the CLI's
   * token store for this URL. In the browser it is required. */
  token?: string;
  /** Node only: a file holding the token. */
  tokenFile?: string;
  /** Send the token in an `auth` first frame instead of an Authorization header (always so
   * where headers cannot be set, as in the browser). */
  authFrame?: boolean;
  /** How to open WebSockets (default: the platform's). */
  webSocket?: WebSocketFactory;
  /** How long the handshake may take; default 10 s. */
  openTimeoutMs?: number;
}

/** What the platform plugs in: node.ts sets the `ws` package and token discovery. */
export interface Platform {
  webSocket: () => WebSocketFactory | null;
  resolveToken: (url: string, token: string | undefined, tokenFile: string | undefined) => string;
  /** Why no TCP connection to the URL's address is made, or null where one is (Node only). */
  unreachable?: (url: string) => Promise<string | null>;
}

const platform: Platform = {
  webSocket: globalWebSocketFactory,
  resolveToken: (url, token, tokenFile) => {
    if (tokenFile) throw new TypeError("tokenFile needs Node: pass token instead");
    if (!token) throw new AuthError(`no token for ${url}: pass {token} (in the browser only an explicit token is used)`);
    return token;
  },
};

export function setPlatform(p: Partial<Platform>): void {
  Object.assign(platform, p);
}

export interface ExecOptions {
  /** The process id (chosen here when absent); exec is idempotent per id. */
  proc?: string;
  /** Values, like argv's words and cwd, are text or bytes: any not UTF-8 goes as its bytes. */
  env?: Record<string, string | Uint8Array>;
  cwd?: string | Uint8Array;
  /** A pty (of cols x rows, 80x24 unless given). */
  tty?: boolean;
  /** Keep stdin open for `handle.write()`. */
  stdin?: boolean;
  cols?: number;
  rows?: number;
  branch?: string;
  /** Follow the journal from this seq (default: just before the reply's `started_seq`). */
  since?: number;
}

let procCounter = 0;
const procPrefix = `ts-${Math.random().toString(36).slice(2, 8)}`;

/** A connected box: `const box = await Box.connect(url, {token})`, then `box.close()`.
 *
 * Requests go over one control connection; each `events()` stream and each process handle
 * follows the journal over a connection of its own, so a slow event reader never delays a
 * request and a reconnect never loses a reply. */
export class Box {
  /** File operations: `box.fs.read/write/list/stat/mkdir/remove`. */
  readonly fs: FileSystem;
  private readonly streams = new Set<EventStream>();
  private readonly procs = new Set<Process>();

  private constructor(
    readonly url: string,
    private readonly token: string,
    private readonly conn: Connection,
    private readonly factory: WebSocketFactory,
    private readonly authFrame: boolean,
    private readonly openTimeoutMs: number,
  ) {
    this.fs = new FileSystem(() => this.conn);
  }

  /** Connects to the box at `url` (`ws://host:port` or `wss://...`). Rejects with AuthError when
   * the server refuses the token, ConnectionLost when the box is unreachable, TypeError for a
   * URL that is not ws:// or wss://. */
  static async connect(url: string, opts: ConnectOptions = {}): Promise<Box> {
    checkUrl(url);
    let token: string;
    try {
      token = platform.resolveToken(url, opts.token, opts.tokenFile);
    } catch (e) {
      // A box that ended removed the token it stored: where nothing answers either, that is the
      // news (a box started by `sandboxer run --listen` that has exited).
      const why = e instanceof AuthError && platform.unreachable ? await platform.unreachable(url) : null;
      if (why === null) throw e;
      throw new ConnectionLost(
        `${(e as AuthError).detail}; and no box answers at ${url}: ${why} (a box removes the token it stored when it ends)`,
      );
    }
    const factory = opts.webSocket ?? platform.webSocket();
    if (!factory) throw new TypeError("no WebSocket on this platform: pass {webSocket}, or install the ws package");
    const authFrame = opts.authFrame ?? !factory.headers;
    const openTimeoutMs = opts.openTimeoutMs ?? 10_000;
    const sock = await Socket.open(url, token, { factory, authFrame, openTimeoutMs });
    const box = new Box(url, token, new Connection(sock), factory, authFrame, openTimeoutMs);
    if (authFrame) {
      // The server answers a refused auth frame with close 4401: make that visible here rather
      // than at the first request, by a round trip that needs authentication.
      await box.stats();
    }
    return box;
  }

  /** Closes the control connection, every event stream and every process handle (the box and
   * its processes keep running). */
  async close(): Promise<void> {
    await Promise.all([...this.procs].map((p) => p.close()));
    for (const s of [...this.streams]) s.close();
    this.conn.close();
  }

  /** Sends any operation and resolves with its reply; rejects with SandboxerError (the server's
   * `code` and `message`) on `ok: false`. Fields that are undefined or null are left out. */
  request(op: string, fields: Record<string, unknown> = {}): Promise<JsonObject> {
    return this.conn.request(op, fields);
  }

  private streamContext() {
    return {
      openSocket: () => Socket.open(this.url, this.token, { factory: this.factory, authFrame: this.authFrame, openTimeoutMs: this.openTimeoutMs }),
      streams: this.streams,
    };
  }

  /** Every event with seq > `since` (of `branch` only, when given), then the live stream:
   * `for await (const ev of box.events({since}))`. It resumes by itself after a close 4008 or a
   * lost connection, with no gap and no duplicate. */
  events(opts: EventsOptions = {}): EventStream {
    return new EventStream(this.streamContext(), opts);
  }

  /** Starts `argv` in the box and resolves with its handle, output streaming in. */
  async exec(argv: (string | Uint8Array)[], opts: ExecOptions = {}): Promise<Process> {
    if (argv.length === 0) throw new TypeError("exec needs a non-empty argv");
    const proc = opts.proc ?? `${procPrefix}-${++procCounter}`;
    const reply = await this.conn.request("exec", {
      proc,
      ...listTextOrB64("argv", argv),
      ...envTextOrB64(opts.env),
      ...(opts.cwd !== undefined ? textOrB64("cwd", opts.cwd) : {}),
      tty: opts.tty ?? false,
      stdin: opts.stdin ?? false,
      cols: opts.cols,
      rows: opts.rows,
      branch: opts.branch,
    });
    let since = opts.since;
    if (since === undefined) {
      // The reply names the seq of `proc.started`, the process's first event: follow from there.
      const s = reply.started_seq;
      since = typeof s === "number" && s > 0 ? s - 1 : 0;
    }
    const branch = typeof reply.branch === "string" ? reply.branch : opts.branch;
    const stream = new EventStream(this.streamContext(), { since, branch, where: (e: Event) => e.proc === proc });
    const p = new Process(this, proc, reply, stream);
    this.procs.add(p);
    return p;
  }

  // Process ids are per branch: `branch` says which branch's `proc`; without it the box takes
  // the one process of that id, and refuses (`ambiguous_proc`) when several branches have one.

  /** Writes `data` to the stdin of process `proc`; `eof` closes it after the data. */
  async stdin(proc: string, data: Uint8Array | string, opts: { eof?: boolean; branch?: string } = {}): Promise<void> {
    const d = typeof data === "string" ? data.length > 0 : data.length > 0;
    await this.conn.request("stdin", { proc, ...(d ? textOrB64("data", data) : {}), eof: opts.eof || undefined, branch: opts.branch });
  }

  /** Sends `signal` (a name like "TERM" or a number) to process `proc`. */
  async signal(proc: string, signal: string | number, opts: { branch?: string } = {}): Promise<void> {
    await this.conn.request("signal", { proc, signal, branch: opts.branch });
  }

  /** Sets the pty size of process `proc`. */
  async resize(proc: string, cols: number, rows: number, opts: { branch?: string } = {}): Promise<void> {
    await this.conn.request("resize", { proc, cols, rows, branch: opts.branch });
  }

  /** Resource use of the box, its branches and processes (cpu, memory, pids, disk). */
  async stats(): Promise<JsonObject> {
    return body(await this.conn.request("stats"));
  }

  /** Ends the box: TERM to every process, `grace` (seconds, or "3s"), then KILL. */
  shutdown(grace?: number | string): Promise<JsonObject> {
    return this.conn.request("shutdown", { grace });
  }

  /** Checkpoints the agent (memory and files at one instant); the reply has the snapshot id. */
  checkpoint(name?: string, opts: { leaveRunning?: boolean; branch?: string } = {}): Promise<JsonObject> {
    return this.conn.request("checkpoint", { name, leave_running: opts.leaveRunning ?? true, branch: opts.branch });
  }

  /**
   * Restores snapshot `snapshot` in this box, as a new branch. With `index`, an idle box
   * (`sandboxer-init --idle`) becomes that copy of the snapshot instead, and ends with it.
   */
  restore(snapshot: string, index?: number): Promise<JsonObject> {
    return this.conn.request("restore", { snapshot, index });
  }

  /** Starts `n` copies of snapshot `snapshot` in this box, each a branch of its own. */
  fork(snapshot: string, n = 1): Promise<JsonObject> {
    return this.conn.request("fork", { snapshot, n });
  }

  /** The snapshots the box holds. */
  async snapshots(): Promise<JsonObject[]> {
    return replyArray(await this.conn.request("snapshot.list"), "snapshots", "snapshot.list") as JsonObject[];
  }

  async deleteSnapshot(snapshot: string): Promise<void> {
    await this.conn.request("snapshot.delete", { snapshot });
  }

  /**
   * The archive of snapshot `snapshot` (received in binary frames). With `base`, a delta instead:
   * only the chunks `base` lacks, for a box that has `base` (importSnapshot takes it).
   */
  async exportSnapshot(snapshot: string, base?: string): Promise<Uint8Array> {
    const recv = new Receiver(`snapshot.export ${snapshot}`);
    const fields: JsonObject = base ? { snapshot, base } : { snapshot };
    const reply = await this.conn.request("snapshot.export", fields, { sink: recv.sink });
    try {
      return await recv.result(this.conn, reply);
    } finally {
      this.conn.dropSink(reply.id as number);
    }
  }

  /** Uploads a snapshot archive (in binary frames); the reply has its id. */
  importSnapshot(archive: Uint8Array): Promise<JsonObject> {
    return this.conn.request("snapshot.import", { size: archive.length }, {
      afterSend: async (id) => {
        for (const frame of iterChunks(id, archive)) {
          if (this.conn.replied(id)) break;
          await this.conn.sendBinary(frame);
        }
      },
    });
  }
}

