/** One WebSocket, whatever the platform gives: the browser's `WebSocket`, Node's `ws` package or
 * Node's own `WebSocket`. Everything above this file sees only `Socket`. Browser-safe. */
import { AuthError, ConnectionLost, type SandboxerError } from "./errors.js";
import { CLOSE_AUTH, HEADER_SIZE, MAX_CHUNK, SUBPROTOCOL } from "./protocol.js";

/** The part of the WHATWG WebSocket API this SDK uses (the `ws` package has it too). `pause`
 * and `resume` (the `ws` package's) let a slow event reader stop reading, so the server sees it
 * as slow instead of the client buffering without bound. */
export interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  readonly bufferedAmount: number;
  send(data: string | Uint8Array): void;
  close(code?: number, reason?: string): void;
  addEventListener(type: string, listener: (ev: any) => void): void;
  pause?(): void;
  resume?(): void;
}

/** How to open a WebSocket. `headers` is false where the platform cannot send request headers
 * (the browser): the token then goes in an `auth` first frame. */
export interface WebSocketFactory {
  open(url: string, protocols: string[], headers: Record<string, string> | undefined, openTimeoutMs: number): WebSocketLike;
  headers: boolean;
}

/** The platform's global WebSocket (the browser's; Node 22's), which sends no headers. */
export function globalWebSocketFactory(): WebSocketFactory | null {
  const WS = (globalThis as { WebSocket?: new (url: string, protocols: string[]) => WebSocketLike }).WebSocket;
  if (typeof WS !== "function") return null;
  return { open: (url, protocols) => new WS(url, protocols), headers: false };
}

/** The close frame's code and reason; code null when the connection just broke (no frame). */
export interface CloseInfo {
  code: number | null;
  reason: string;
}

export type Incoming = string | Uint8Array;

/** Refuses a URL that is not ws:// or wss:// with a host, naming what is wrong. */
export function checkUrl(url: string): void {
  let u: URL;
  try {
    u = new URL(url);
  } catch {
    throw new TypeError(`box URL ${JSON.stringify(url)}: expected ws://HOST:PORT or wss://HOST:PORT`);
  }
  if (u.protocol !== "ws:" && u.protocol !== "wss:") {
    throw new TypeError(`box URL ${JSON.stringify(url)}: expected ws://HOST:PORT or wss://HOST:PORT`);
  }
  if (!u.hostname) throw new TypeError(`box URL ${JSON.stringify(url)} has no host`);
}

/** The error for a connection that closed under `what`: AuthError for 4401. */
export function lostError(what: string, info: CloseInfo): SandboxerError {
  if (info.code === CLOSE_AUTH) {
    return new AuthError(`${what}: the server refused the token (close 4401${info.reason ? ": " + info.reason : ""})`);
  }
  const detail = info.code !== null ? `close ${info.code}${info.reason ? " " + info.reason : ""}` : "connection lost";
  return new ConnectionLost(`${what}: ${detail}`, info.code, info.reason);
}

export interface OpenOptions {
  factory: WebSocketFactory;
  authFrame: boolean;
  openTimeoutMs: number;
}

/** An open `sandboxer.v1` WebSocket. `onMessage` and `onClose` are set by its one owner. */
export class Socket {
  onMessage: (m: Incoming) => void = () => {};
  onClose: (info: CloseInfo) => void = () => {};
  closed: CloseInfo | null = null;
  private paused = false;

  private constructor(readonly ws: WebSocketLike) {}

  /** Opens a WebSocket to `url` with `token` (a bearer header, or an `auth` first frame where
   * headers cannot be sent or `authFrame` asks for it). Rejects with AuthError on HTTP 401,
   * ConnectionLost when the box is unreachable. */
  static open(url: string, token: string, opts: OpenOptions): Promise<Socket> {
    const frame = opts.authFrame || !opts.factory.headers;
    const headers = frame ? undefined : { Authorization: `Bearer ${token}` };
    return new Promise((resolve, reject) => {
      let ws: WebSocketLike;
      try {
        ws = opts.factory.open(url, [SUBPROTOCOL], headers, opts.openTimeoutMs);
      } catch (e) {
        reject(new ConnectionLost(`connect ${url}: ${(e as Error).message}`));
        return;
      }
      ws.binaryType = "arraybuffer";
      const sock = new Socket(ws);
      let opened = false;
      let errText = "";
      const timer = setTimeout(() => {
        if (!opened) {
          errText = `no answer within ${opts.openTimeoutMs} ms`;
          ws.close();
        }
      }, opts.openTimeoutMs);
      ws.addEventListener("open", () => {
        opened = true;
        clearTimeout(timer);
        if (frame) ws.send(JSON.stringify({ op: "auth", token }));
        resolve(sock);
      });
      ws.addEventListener("error", (ev: { message?: string; error?: Error }) => {
        errText ||= ev?.message ?? ev?.error?.message ?? "";
      });
      ws.addEventListener("message", (ev: { data: unknown }) => {
        const d = ev.data;
        if (typeof d === "string") sock.onMessage(d);
        else if (d instanceof ArrayBuffer) sock.onMessage(new Uint8Array(d));
        else if (ArrayBuffer.isView(d)) sock.onMessage(new Uint8Array(d.buffer, d.byteOffset, d.byteLength));
      });
      ws.addEventListener("close", (ev: { code?: number; reason?: string }) => {
        clearTimeout(timer);
        // 1005 (no status) and 1006 (abnormal) are what the API reports when no frame came.
        const code = ev.code === undefined || ev.code === 1005 || ev.code === 1006 ? null : ev.code;
        const info = { code, reason: ev.reason ?? "" };
        sock.closed = info;
        if (!opened) {
          // The `ws` package reports a refused handshake as "Unexpected server response: 401".
          if (/\b401\b/.test(errText)) reject(new AuthError(`${url} refused the token (HTTP 401)`));
          else reject(new ConnectionLost(`connect ${url}: ${errText || "connection refused"}`, code, info.reason));
          return;
        }
        sock.onClose(info);
      });
    });
  }

  send(data: string | Uint8Array): void {
    this.ws.send(data);
  }

  /** Waits until the socket's send buffer is below `limit` bytes, so an upload does not queue
   * a whole file in memory. */
  async drain(limit = 4 * (HEADER_SIZE + MAX_CHUNK)): Promise<void> {
    while (this.closed === null && this.ws.bufferedAmount > limit) await sleep(5);
  }

  /** Stops reading from the network where the platform allows it (the `ws` package). */
  pause(): boolean {
    if (!this.ws.pause || this.paused) return this.paused;
    this.ws.pause();
    this.paused = true;
    return true;
  }

  resume(): void {
    if (this.paused && this.ws.resume) this.ws.resume();
    this.paused = false;
  }

  close(code = 1000): void {
    if (this.closed === null) this.ws.close(code);
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}
