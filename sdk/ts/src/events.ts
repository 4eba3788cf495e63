/** The event stream: `subscribe{since, branch}` on a WebSocket of its own, resumed from the last
 * seq it delivered whenever that connection drops (close 4008 `resume_after=N`, or a broken
 * connection), so its consumer sees every event once, in order. Browser-safe. */
import { AuthError, ConnectionLost, SandboxerError, type Json, type JsonObject } from "./errors.js";
import { classify, CLOSE_AUTH, CLOSE_SLOW, type Event } from "./protocol.js";
import { lostError, sleep, Socket, type CloseInfo, type Incoming } from "./socket.js";

/** What a stream needs from its box: how to open one more authenticated socket. */
export interface StreamContext {
  openSocket(): Promise<Socket>;
  streams: Set<EventStream>;
}

export interface EventsOptions {
  /** Every event with seq > since (default 0: the whole journal). */
  since?: number;
  /** Only this branch's events. */
  branch?: string;
  /** Give up (ConnectionLost) when the box stays unreachable this long; default 30 s. */
  reconnectTimeoutMs?: number;
  /** A client-side filter; seq tracking still sees every event. */
  where?: (ev: Event) => boolean;
}

type Item = { msg: Incoming } | { close: CloseInfo };

// Messages buffered before the stream stops reading its socket (where the platform allows it),
// so that a consumer that does not keep up is seen as slow by the server (close 4008) rather
// than filling this process's memory (an output event can carry 64 KiB); reading resumes below
// RESUME_AT.
const PAUSE_AT = 64;
const RESUME_AT = 16;

/** An async iterator of the box's events after `since` (live once the history is sent).
 *
 * When its connection drops it reconnects and resubscribes with `since` = the last seq it
 * yielded, and skips any event it already yielded: the consumer sees exactly the sequence an
 * uninterrupted client would. It ends when the server closes normally (1000/1001: the box ended)
 * or after `close()` (or a `break` out of `for await`); it throws ConnectionLost when it cannot
 * reconnect within `reconnectTimeoutMs`, AuthError when the token is refused, SandboxerError when
 * the server rejects the subscription. */
export class EventStream implements AsyncIterableIterator<Event> {
  readonly since: number;
  readonly branch: string | undefined;
  /** The seq of the last event delivered (or skipped by `where`). */
  lastSeq: number;
  reconnects = 0;
  /** Code and reason of every close or loss of its connection (code null: no close frame). */
  readonly closes: CloseInfo[] = [];
  private readonly reconnectTimeoutMs: number;
  private readonly where: ((ev: Event) => boolean) | undefined;
  private sock: Socket | null = null;
  private queue: Item[] = [];
  private wake: (() => void) | null = null;
  private ended = false;
  private idleLosses = 0;
  private subId = 0;

  constructor(private readonly ctx: StreamContext, opts: EventsOptions = {}) {
    this.since = opts.since ?? 0;
    this.lastSeq = this.since;
    this.branch = opts.branch;
    this.reconnectTimeoutMs = opts.reconnectTimeoutMs ?? 30_000;
    this.where = opts.where;
  }

  [Symbol.asyncIterator](): this {
    return this;
  }

  /** Closes the stream's connection; iteration then ends. */
  close(): void {
    this.ended = true;
    const s = this.sock;
    this.sock = null;
    this.ctx.streams.delete(this);
    s?.close();
    this.poke();
  }

  async return(): Promise<IteratorResult<Event>> {
    this.close();
    return { done: true, value: undefined };
  }

  async next(): Promise<IteratorResult<Event>> {
    for (;;) {
      if (this.ended) return { done: true, value: undefined };
      if (this.sock === null) await this.subscribe();
      const item = await this.take();
      if (item === null) continue; // closed by the client: `ended` is set
      if ("close" in item) {
        await this.onLost(item.close);
        continue;
      }
      const ev = this.accept(item.msg);
      if (ev !== null) return { done: false, value: ev };
    }
  }

  private poke(): void {
    const w = this.wake;
    this.wake = null;
    w?.();
  }

  private async take(): Promise<Item | null> {
    while (this.queue.length === 0) {
      if (this.ended) return null;
      await new Promise<void>((r) => (this.wake = r));
    }
    const item = this.queue.shift()!;
    if (this.queue.length < RESUME_AT) this.sock?.resume();
    return item;
  }

  /** Connects and subscribes from `lastSeq`, retrying while the box is unreachable. */
  private async subscribe(): Promise<void> {
    const deadline = Date.now() + this.reconnectTimeoutMs;
    let delay = 50;
    let sock: Socket;
    for (;;) {
      try {
        sock = await this.ctx.openSocket();
        break;
      } catch (e) {
        if (e instanceof AuthError || !(e instanceof ConnectionLost) || Date.now() >= deadline) {
          this.close();
          throw e;
        }
        await sleep(delay);
        delay = Math.min(delay * 2, 1000);
      }
    }
    if (this.ended) {
      sock.close();
      return;
    }
    sock.onMessage = (msg) => {
      this.queue.push({ msg });
      if (this.queue.length >= PAUSE_AT) sock.pause();
      this.poke();
    };
    sock.onClose = (info) => {
      this.queue.push({ close: info });
      this.poke();
    };
    this.subId += 1;
    const req: Record<string, unknown> = { id: this.subId, op: "subscribe", since: this.lastSeq };
    if (this.branch !== undefined) req.branch = this.branch;
    sock.send(JSON.stringify(req));
    this.sock = sock;
    this.ctx.streams.add(this);
  }

  private async onLost(info: CloseInfo): Promise<void> {
    if (this.ended) return;
    this.sock = null;
    this.ctx.streams.delete(this);
    this.closes.push(info);
    if (info.code === 1000 || info.code === 1001) {
      this.ended = true;
      return;
    }
    if (info.code === CLOSE_AUTH) {
      this.ended = true;
      throw lostError("subscribe", info);
    }
    // On 4008 (too slow for the server's queue) the journal has everything: resume after the
    // last seq this stream delivered, never after the server's N, since frames sent before the
    // close may have been lost with the connection here and N would skip them. Events seen
    // twice are dropped in accept(). A server that keeps dropping us before sending anything
    // is not hammered: back off.
    if (info.code !== CLOSE_SLOW && this.idleLosses > 0) await sleep(Math.min(50 * 2 ** this.idleLosses, 1000));
    this.idleLosses += 1;
    this.reconnects += 1;
  }

  /** The event a text frame carries, if it is one this stream has not delivered yet. */
  private accept(msg: Incoming): Event | null {
    if (typeof msg !== "string") return null;
    let obj: Json;
    try {
      obj = JSON.parse(msg) as Json;
    } catch {
      return null;
    }
    const kind = classify(obj);
    if (kind === "reply") {
      const r = obj as JsonObject;
      if (r.ok !== true && r.id === this.subId) {
        this.close();
        throw SandboxerError.fromReply(r, "subscribe");
      }
      return null;
    }
    if (kind !== "event") return null;
    const ev = obj as Event;
    if (ev.seq <= this.lastSeq) return null; // delivered before a reconnect
    this.lastSeq = ev.seq;
    this.idleLosses = 0;
    if (this.where && !this.where(ev)) return null;
    return ev;
  }
}
