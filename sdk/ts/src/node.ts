/** @sandboxer/sdk for Node: the browser-safe core, plus token discovery (argument, token file,
 * SANDBOXER_TOKEN, the CLI's per-URL store) and WebSockets from the `ws` package, which sends the
 * token as a header and lets a slow reader push back. Without `ws`, Node's own WebSocket (Node
 * 22) is used with an auth frame. */
import { connect as netConnect } from "node:net";
import { setPlatform } from "./box.js";
import { HEADER_SIZE, MAX_CHUNK } from "./protocol.js";
import { globalWebSocketFactory, type WebSocketFactory, type WebSocketLike } from "./socket.js";
import { resolveToken } from "./tokens.js";

export * from "./index.js";
export { resolveToken, storeToken, tokenKey, tokenPath, readTokenFile, stateHome } from "./tokens.js";

type WsCtor = new (url: string, protocols: string[], opts: Record<string, unknown>) => WebSocketLike;

const ws: { default?: WsCtor; WebSocket?: WsCtor } | null = await import("ws").catch(() => null);
const WsClass: WsCtor | undefined = ws?.WebSocket ?? ws?.default;

/** WebSockets from the `ws` package: the token in an Authorization header; frames up to one
 * binary chunk plus slack. */
export function wsFactory(extra: Record<string, unknown> = {}): WebSocketFactory | null {
  if (!WsClass) return null;
  const C = WsClass;
  return {
    headers: true,
    open: (url, protocols, headers, openTimeoutMs) =>
      new C(url, protocols, { headers, perMessageDeflate: false, maxPayload: HEADER_SIZE + MAX_CHUNK + 1024, handshakeTimeout: openTimeoutMs, ...extra }),
  };
}

/** Why a TCP connection to `url`'s host and port is not made within `timeoutMs` ("Connection
 * refused (nothing listens on HOST:PORT)"), or null where one is accepted (and closed at once).
 * As the CLI's `unreachable` (cli/session.cpp). */
function unreachable(url: string, timeoutMs = 2000): Promise<string | null> {
  const u = new URL(url);
  const host = u.hostname.replace(/^\[(.*)\]$/, "$1");
  const port = Number(u.port || (u.protocol === "wss:" ? 443 : 80));
  const where = `${host}:${port}`;
  return new Promise((done) => {
    const s = netConnect({ host, port });
    const timer = setTimeout(() => {
      s.destroy();
      done(`no answer within ${timeoutMs / 1000} s (${where})`);
    }, timeoutMs);
    s.once("connect", () => {
      clearTimeout(timer);
      s.destroy();
      done(null);
    });
    s.once("error", (e: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      done(e.code === "ECONNREFUSED" ? `Connection refused (nothing listens on ${where})` : `${e.message} (${where})`);
    });
  });
}

setPlatform({
  webSocket: () => wsFactory() ?? globalWebSocketFactory(),
  resolveToken: (url, token, tokenFile) => resolveToken(url, token, tokenFile),
  unreachable: (url) => unreachable(url),
});
