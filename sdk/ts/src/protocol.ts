/** The sandboxer.v1 protocol's shapes (tests/protocol/README.md): frame kinds, close codes,
 * binary frame headers, output bytes. Browser-safe: no Node module is imported here. */
import type { JsonObject } from "./errors.js";

export const SUBPROTOCOL = "sandboxer.v1";
export const CLOSE_AUTH = 4401;
export const CLOSE_SLOW = 4008;
/** The largest text frame the server takes. */
export const MAX_TEXT = 1 << 20;
export const HEADER_SIZE = 13;
/** Bytes of data in one binary frame at most. */
export const MAX_CHUNK = 1 << 20;
export const FLAG_LAST = 0x01;

/** An event of the journal: `seq` and `type`, and whatever fields its type has. */
export type Event = JsonObject & { seq: number; type: string };

/** What a text frame from the server is: "reply" (has `id` and `ok`), "event" (has an integer
 * `seq` and a `type`, never `id`), or "other". */
export function classify(obj: unknown): "reply" | "event" | "other" {
  if (obj === null || typeof obj !== "object" || Array.isArray(obj)) return "other";
  const o = obj as Record<string, unknown>;
  if ("ok" in o && "id" in o) return "reply";
  if (Number.isInteger(o.seq) && "type" in o && !("id" in o)) return "event";
  return "other";
}

/** N of a close reason `resume_after=N`, or null when the reason has another shape. */
export function parseResumeAfter(reason: string): number | null {
  const m = /^resume_after=([0-9]+)$/.exec(reason.trim());
  return m ? Number(m[1]) : null;
}

/** One binary frame: which request it belongs to, where its data goes, and the data. */
export interface Chunk {
  requestId: number;
  offset: number;
  flags: number;
  last: boolean;
  data: Uint8Array;
}

/** A whole binary frame (13-byte little-endian header: u32 id, u64 offset, u8 flags; then the
 * data). `flags` carries bits other than "last" (reserved today). */
export function encodeChunk(requestId: number, offset: number, data: Uint8Array, last: boolean, flags = 0): Uint8Array {
  if (!Number.isInteger(requestId) || requestId < 0 || requestId > 0xffffffff) {
    throw new RangeError(`request id ${requestId} does not fit in u32`);
  }
  if (!Number.isSafeInteger(offset) || offset < 0) throw new RangeError(`offset ${offset} is not a u64 this client can hold`);
  if (data.length > MAX_CHUNK) throw new RangeError(`chunk of ${data.length} bytes exceeds the ${MAX_CHUNK}-byte frame limit`);
  const out = new Uint8Array(HEADER_SIZE + data.length);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, requestId, true);
  dv.setBigUint64(4, BigInt(offset), true);
  dv.setUint8(12, (flags & ~FLAG_LAST & 0xff) | (last ? FLAG_LAST : 0));
  out.set(data, HEADER_SIZE);
  return out;
}

/** Parses a binary frame; throws RangeError naming what is wrong with a malformed one. */
export function decodeChunk(frame: Uint8Array): Chunk {
  if (frame.length < HEADER_SIZE) {
    throw new RangeError(`binary frame of ${frame.length} bytes is shorter than the ${HEADER_SIZE}-byte header`);
  }
  const dv = new DataView(frame.buffer, frame.byteOffset, frame.byteLength);
  const off = dv.getBigUint64(4, true);
  if (off > BigInt(Number.MAX_SAFE_INTEGER)) throw new RangeError(`binary frame offset ${off} exceeds 2^53`);
  const data = frame.subarray(HEADER_SIZE);
  if (data.length > MAX_CHUNK) throw new RangeError(`binary frame carries ${data.length} bytes, more than ${MAX_CHUNK}`);
  const flags = dv.getUint8(12);
  return { requestId: dv.getUint32(0, true), offset: Number(off), flags, last: (flags & FLAG_LAST) !== 0, data };
}

/** `data` as consecutive frames of at most `chunkSize` bytes; empty data is one empty frame
 * marked last. */
export function* iterChunks(requestId: number, data: Uint8Array, chunkSize = MAX_CHUNK): Generator<Uint8Array> {
  if (!(chunkSize > 0 && chunkSize <= MAX_CHUNK)) throw new RangeError(`chunk size ${chunkSize} must be in 1..${MAX_CHUNK}`);
  if (data.length === 0) {
    yield encodeChunk(requestId, 0, data, true);
    return;
  }
  for (let off = 0; off < data.length; off += chunkSize) {
    yield encodeChunk(requestId, off, data.subarray(off, off + chunkSize), off + chunkSize >= data.length);
  }
}

const encoder = new TextEncoder();
const strictDecoder = new TextDecoder("utf-8", { fatal: true });

export function utf8(s: string): Uint8Array {
  return encoder.encode(s);
}

/** The text of `b` when it is valid UTF-8, else null. */
export function utf8Text(b: Uint8Array): string | null {
  try {
    return strictDecoder.decode(b);
  } catch {
    return null;
  }
}

export function toBase64(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode(...b.subarray(i, i + 0x8000));
  return btoa(s);
}

export function fromBase64(s: string): Uint8Array {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** A field of text or bytes (a path, an entry's `name_b64` decoded; stdin's or a file's content):
 * `{key}` when the bytes are UTF-8 text, else `{key_b64}` (base64 of the bytes), which the box
 * takes in place of `key`. */
export function textOrB64(key: string, value: Uint8Array | string): Record<string, string> {
  const t = typeof value === "string" ? value : utf8Text(value);
  return t !== null ? { [key]: t } : { [`${key}_b64`]: toBase64(value as Uint8Array) };
}

/** A list of such fields (exec's argv) as one: `key`, an array of text, where every item is
 * UTF-8, else `key`_b64, every item's base64. */
export function listTextOrB64(key: string, values: (Uint8Array | string)[]): Record<string, string[]> {
  const texts = values.map((v) => (typeof v === "string" ? v : utf8Text(v)));
  if (texts.every((t) => t !== null)) return { [key]: texts as string[] };
  return { [`${key}_b64`]: values.map((v) => toBase64(typeof v === "string" ? utf8(v) : v)) };
}

/** exec's environment: `env` where every value is UTF-8, else `env_b64` with every value's
 * base64 (the names are text either way). */
export function envTextOrB64(env: Record<string, Uint8Array | string> | undefined): Record<string, Record<string, string>> {
  if (!env) return {};
  const names = Object.keys(env);
  const fields = listTextOrB64("v", names.map((n) => env[n]));
  const values = fields.v ?? fields.v_b64;
  const out: Record<string, string> = {};
  names.forEach((n, i) => (out[n] = values[i]));
  return { [fields.v ? "env" : "env_b64"]: out };
}

/** The bytes of a `proc.output` event (`data` is UTF-8 text, `data_b64` raw bytes). */
export function outputBytes(ev: JsonObject): Uint8Array {
  if (typeof ev.data_b64 === "string") return fromBase64(ev.data_b64);
  return utf8(typeof ev.data === "string" ? ev.data : "");
}

export function concatBytes(parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.length;
  const out = new Uint8Array(n);
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.length;
  }
  return out;
}
