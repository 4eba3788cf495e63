/** Requests and replies over one Socket, matched by id; binary frames routed to the sink of
 * their request id. Browser-safe. */
import { ConnectionLost, ProtocolError, SandboxerError, type Json, type JsonObject } from "./errors.js";
import { classify, decodeChunk, MAX_TEXT, utf8, type Chunk } from "./protocol.js";
import { lostError, Socket, type CloseInfo } from "./socket.js";

export type BinarySink = (c: Chunk) => void;

export interface RequestOptions {
  /** Receives the request's binary frames until `dropSink(id)`: content may follow the reply. */
  sink?: BinarySink;
  /** Runs once the request is sent (e.g. to stream binary frames up). */
  afterSend?: (id: number) => Promise<void>;
  /** When false, an `ok: false` reply is returned instead of thrown. */
  raiseError?: boolean;
}

interface Pending {
  op: string;
  resolve: (r: JsonObject) => void;
  reject: (e: SandboxerError) => void;
  done: boolean;
}

export class Connection {
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private readonly sinks = new Map<number, BinarySink>();
  private closeWaiters: Array<(e: SandboxerError) => void> = [];
  /** Why the connection is closed, or null while it is open. */
  closedError: SandboxerError | null = null;

  constructor(readonly socket: Socket) {
    socket.onMessage = (m) => (typeof m === "string" ? this.onText(m) : this.onBinary(m));
    socket.onClose = (info: CloseInfo) => this.setClosed(lostError("connection", info));
  }

  newId(): number {
    const id = this.nextId;
    this.nextId = id < 0xffffffff ? id + 1 : 1;
    return id;
  }

  /** Sends `{id, op, ...fields}` (fields that are undefined or null are left out) and resolves
   * with its reply; rejects with SandboxerError carrying the server's code on `ok: false`. */
  async request(op: string, fields: Record<string, unknown> = {}, opts: RequestOptions = {}): Promise<JsonObject> {
    if ("id" in fields || "op" in fields) throw new TypeError("request fields cannot be named id or op: those are the envelope's");
    if (this.closedError) throw this.closedError;
    const id = this.newId();
    const msg: Record<string, unknown> = { id, op };
    for (const [k, v] of Object.entries(fields)) if (v !== undefined && v !== null) msg[k] = v;
    let text: string;
    try {
      // JSON has no NaN or Infinity: JSON.stringify would send null in their place.
      text = JSON.stringify(msg, (k, v: unknown) => {
        if (typeof v === "number" && !Number.isFinite(v)) throw new TypeError(`field ${k} is ${v}, not a finite number`);
        return v;
      });
    } catch (e) {
      throw new SandboxerError("bad_request", `request is not expressible as JSON: ${(e as Error).message}`, { op });
    }
    const size = utf8(text).length;
    if (size > MAX_TEXT) throw new SandboxerError("too_large", `request of ${size} bytes exceeds the 1 MiB text frame limit`, { op });
    const reply = new Promise<JsonObject>((resolve, reject) => {
      this.pending.set(id, { op, resolve, reject, done: false });
    });
    if (opts.sink) this.sinks.set(id, opts.sink);
    let r: JsonObject;
    try {
      this.socket.send(text);
      if (opts.afterSend) await opts.afterSend(id);
      r = await reply;
    } catch (e) {
      this.sinks.delete(id);
      throw e;
    } finally {
      this.pending.delete(id);
    }
    if (r.ok !== true) {
      this.sinks.delete(id);
      if (opts.raiseError !== false) throw SandboxerError.fromReply(r, op);
    }
    return r;
  }

  dropSink(id: number): void {
    this.sinks.delete(id);
  }

  /** True once request `id` has its reply (e.g. an early refusal of an upload). */
  replied(id: number): boolean {
    const p = this.pending.get(id);
    return p === undefined || p.done;
  }

  async sendBinary(frame: Uint8Array): Promise<void> {
    if (this.closedError) throw this.closedError;
    await this.socket.drain();
    if (this.closedError) throw this.closedError;
    this.socket.send(frame);
  }

  /** Resolves with why the connection closed, once it has. */
  waitClosed(): Promise<SandboxerError> {
    if (this.closedError) return Promise.resolve(this.closedError);
    return new Promise((r) => this.closeWaiters.push(r));
  }

  close(): void {
    this.socket.close();
    this.setClosed(new ConnectionLost("connection closed by the client", 1000));
  }

  private setClosed(err: SandboxerError): void {
    if (this.closedError) return;
    this.closedError = err;
    for (const p of this.pending.values()) {
      if (!p.done) {
        p.done = true;
        p.reject(err);
      }
    }
    for (const w of this.closeWaiters) w(err);
    this.closeWaiters = [];
  }

  private onBinary(b: Uint8Array): void {
    let c: Chunk;
    try {
      c = decodeChunk(b);
    } catch {
      return; // a malformed frame belongs to no request: nothing waits for it
    }
    this.sinks.get(c.requestId)?.(c);
  }

  private onText(text: string): void {
    let obj: Json;
    try {
      obj = JSON.parse(text) as Json;
    } catch {
      return;
    }
    if (classify(obj) !== "reply") return; // events, auth acknowledgements: not this connection's
    const o = obj as JsonObject;
    if (typeof o.id !== "number") return;
    const p = this.pending.get(o.id);
    if (p && !p.done) {
      p.done = true;
      p.resolve(o);
    }
  }
}

/** `reply[key]` when it is an array; a ProtocolError naming the field otherwise. */
export function replyArray(reply: JsonObject, key: string, op: string): Json[] {
  const v = reply[key];
  if (!Array.isArray(v)) throw new ProtocolError(`${op} reply has no ${key} list: ${JSON.stringify(reply).slice(0, 300)}`, op);
  return v;
}

/** The reply without its envelope (`id`, `ok`). */
export function body(reply: JsonObject): JsonObject {
  const out: JsonObject = {};
  for (const [k, v] of Object.entries(reply)) if (k !== "id" && k !== "ok") out[k] = v;
  return out;
}
