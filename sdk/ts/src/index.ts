/** @sandboxer/sdk, browser-safe core: `Box`, event streams, process handles, files, typed
 * errors, and the protocol's frames. Node adds token discovery and the `ws` package (node.ts). */
export { Box, setPlatform, type ConnectOptions, type ExecOptions, type Platform } from "./box.js";
export { EventStream, type EventsOptions } from "./events.js";
export { Process } from "./process.js";
export { FileSystem, INLINE_MAX, LIST_PAGE, type Path, type WriteOptions } from "./fs.js";
export { SandboxerError, AuthError, ConnectionLost, ProtocolError, type Json, type JsonObject } from "./errors.js";
export {
  SUBPROTOCOL,
  CLOSE_AUTH,
  CLOSE_SLOW,
  MAX_CHUNK,
  HEADER_SIZE,
  FLAG_LAST,
  classify,
  parseResumeAfter,
  encodeChunk,
  decodeChunk,
  iterChunks,
  outputBytes,
  toBase64,
  fromBase64,
  type Chunk,
  type Event,
} from "./protocol.js";
export { globalWebSocketFactory, type WebSocketFactory, type WebSocketLike, type CloseInfo } from "./socket.js";
