/** Files of the box: fs.read / write / list / stat / mkdir / rename / remove, content in binary
 * frames of at most 1 MiB each (tests/protocol/README.md). Browser-safe. */
import { ProtocolError, type JsonObject } from "./errors.js";
import type { Connection } from "./connection.js";
import { body, replyArray } from "./connection.js";
import { concatBytes, fromBase64, iterChunks, MAX_CHUNK, textOrB64, utf8, type Chunk } from "./protocol.js";

/** fs.write content up to this size goes inside the request. */
export const INLINE_MAX = 32 << 10;
/** Entries a request of FileSystem.list asks for. */
export const LIST_PAGE = 10000;

/** An fs.list entry's name as the bytes on disk (name_b64 where the box gave them). */
function entryName(e: JsonObject): Uint8Array {
  if (typeof e.name_b64 === "string") return fromBase64(e.name_b64);
  if (typeof e.name === "string") return utf8(e.name);
  throw new ProtocolError(`fs.list entry without a name: ${JSON.stringify(e)}`, "fs.list");
}

function compareBytes(a: Uint8Array, b: Uint8Array): number {
  for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i] - b[i];
  return a.length - b.length;
}

/** Collects the binary frames of one transfer; checks they are contiguous. */
export class Receiver {
  private parts: Uint8Array[] = [];
  private size = 0;
  private last = false;
  private error: string | null = null;
  private wake: (() => void) | null = null;

  constructor(private readonly what: string, private readonly base = 0) {}

  readonly sink = (c: Chunk): void => {
    if (this.last) {
      this.error ??= `${this.what}: a binary frame arrived after the last one`;
      return;
    }
    if (c.offset !== this.base + this.size) this.error ??= `${this.what}: frame at offset ${c.offset}, expected ${this.base + this.size}`;
    // The frame's buffer is the socket's: keep a copy.
    this.parts.push(c.data.slice());
    this.size += c.data.length;
    if (c.last) {
      this.last = true;
      this.wake?.();
    }
  };

  /** The content, once the last frame came; rejects when the connection closes first. */
  async result(conn: Connection, reply: JsonObject): Promise<Uint8Array> {
    const expected = typeof reply.length === "number" ? reply.length : typeof reply.size === "number" ? reply.size : null;
    if (!this.last && !(expected === 0 && this.parts.length === 0)) {
      const done = new Promise<void>((r) => (this.wake = r));
      const lost = conn.waitClosed().then((e) => Promise.reject(e));
      lost.catch(() => {});
      await Promise.race([done, lost]);
    }
    if (this.error) throw new ProtocolError(this.error);
    const data = concatBytes(this.parts);
    if (expected !== null && expected !== data.length) {
      throw new ProtocolError(`${this.what}: reply says ${expected} bytes, frames carried ${data.length}`);
    }
    return data;
  }
}

export interface WriteOptions {
  /** Permission bits of a new file. */
  mode?: number;
  append?: boolean;
  /** The data goes to a new file beside it, renamed over it once whole: a reader sees the old
   * file or the new one, never a part, and a write that fails leaves the old one as it was (its
   * mode and owner carry over unless `mode` says). */
  atomic?: boolean;
  branch?: string;
  /** Content inside the request (`data` / `data_b64`) rather than in binary frames; default:
   * up to 32 KiB. */
  inline?: boolean;
  chunkSize?: number;
}

/** A path: text, or bytes (an entry's `name_b64`, decoded) for a name that is not UTF-8. */
export type Path = string | Uint8Array;

/** `box.fs`: the files of the box, confined by the server to the roots its profile allows. Every
 * path is text or bytes (`Path`). */
export class FileSystem {
  constructor(private readonly conn: () => Connection) {}

  /** The content of the file at `path` (`/workspace/...` or `/tmp/...`): all of it, or
   * `length` bytes from `offset`. */
  async read(path: Path, opts: { offset?: number; length?: number; branch?: string } = {}): Promise<Uint8Array> {
    const conn = this.conn();
    const recv = new Receiver(`fs.read ${typeof path === "string" ? path : new TextDecoder().decode(path)}`, opts.offset ?? 0);
    const reply = await conn.request("fs.read", { ...textOrB64("path", path), offset: opts.offset || undefined, length: opts.length, branch: opts.branch }, { sink: recv.sink });
    try {
      return await recv.result(conn, reply);
    } finally {
      conn.dropSink(reply.id as number);
    }
  }

  /** The file's content as UTF-8 text. */
  async readText(path: Path, opts: { branch?: string } = {}): Promise<string> {
    return new TextDecoder().decode(await this.read(path, opts));
  }

  /** Creates or replaces (or with `append`, extends) the file at `path`; resolves with the reply
   * (`size`, `path`) once the server has written every byte. */
  async write(path: Path, data: Uint8Array | string, opts: WriteOptions = {}): Promise<JsonObject> {
    const bytes = typeof data === "string" ? utf8(data) : data;
    const conn = this.conn();
    const fields: Record<string, unknown> = {
      ...textOrB64("path", path),
      mode: opts.mode,
      append: opts.append || undefined,
      atomic: opts.atomic || undefined,
      branch: opts.branch,
    };
    if (opts.inline ?? bytes.length <= INLINE_MAX) return conn.request("fs.write", { ...fields, ...textOrB64("data", bytes) });
    const chunkSize = opts.chunkSize ?? MAX_CHUNK;
    return conn.request("fs.write", fields, {
      afterSend: async (id) => {
        for (const frame of iterChunks(id, bytes, chunkSize)) {
          if (conn.replied(id)) break; // refused (or done) early: the rest would only be ignored
          await conn.sendBinary(frame);
        }
      },
    });
  }

  /** The entries of the directory at `path` (name, type, size, mode; a symlink's text in
   * `target`; `name_b64` / `target_b64` for bytes that are not UTF-8). Sorted by name (its
   * bytes), asked for LIST_PAGE at a time: no reply holds a whole large directory. (A box that
   * does not page answers whole, in the directory's order.) */
  async list(path: Path = "/workspace", opts: { branch?: string } = {}): Promise<JsonObject[]> {
    const entries: JsonObject[] = [];
    let after: Uint8Array | undefined;
    for (;;) {
      const { entries: page, more } = await this.listPage(path, { limit: LIST_PAGE, after, branch: opts.branch });
      entries.push(...page);
      if (!more || page.length === 0) return entries;
      const last = entryName(page[page.length - 1]);
      if (after && compareBytes(last, after) <= 0)
        throw new ProtocolError(`fs.list pages that do not go on past ${JSON.stringify(page[page.length - 1])}`, "fs.list");
      after = last;
    }
  }

  /** One page of the directory at `path`: the first `limit` entries (at most 100,000) whose
   * names come after `after` in byte order, sorted, and whether more follow. The next page
   * starts after the last name of this one (its `name_b64` decoded where it has one). */
  async listPage(
    path: Path = "/workspace",
    opts: { limit: number; after?: Path; branch?: string },
  ): Promise<{ entries: JsonObject[]; more: boolean }> {
    const reply = await this.conn().request("fs.list", {
      ...textOrB64("path", path),
      limit: opts.limit,
      ...(opts.after !== undefined ? textOrB64("after", opts.after) : {}),
      branch: opts.branch,
    });
    const entries = replyArray(reply, "entries", "fs.list") as JsonObject[];
    if (!entries.every((e) => typeof e === "object" && e !== null && !Array.isArray(e)))
      throw new ProtocolError(`fs.list reply has an entry that is not an object: ${JSON.stringify(reply)}`, "fs.list");
    return { entries, more: reply.more === true };
  }

  /** Type, size, mode and mtime of `path`. With `follow: false`, of the entry itself: a symlink
   * there is not followed, and its text is in `target` (its bytes in `target_b64` where they are
   * not UTF-8). */
  async stat(path: Path, opts: { follow?: boolean; branch?: string } = {}): Promise<JsonObject> {
    const follow = opts.follow === false ? false : undefined;
    return body(await this.conn().request("fs.stat", { ...textOrB64("path", path), follow, branch: opts.branch }));
  }

  /** Creates the directory `path`, with the permission bits `mode` (0o755 if none). A directory
   * there already is kept as it is. */
  async mkdir(path: Path, opts: { mode?: number; branch?: string } = {}): Promise<void> {
    await this.conn().request("fs.mkdir", { ...textOrB64("path", path), mode: opts.mode, branch: opts.branch });
  }

  /** Creates a symlink at `path` whose text is `target` (kept as given; the fs operations resolve
   * it beneath its root, as any other). Bytes that are not UTF-8 go as they are. */
  async symlink(path: Path, target: string | Uint8Array, opts: { branch?: string } = {}): Promise<void> {
    await this.conn().request("fs.symlink", { ...textOrB64("path", path), ...textOrB64("target", target), branch: opts.branch });
  }

  /** Sets the permission bits of `path` (0 to 0o7777; a symlink there: of what it names, inside
   * the same root). */
  async chmod(path: Path, mode: number, opts: { branch?: string } = {}): Promise<void> {
    await this.conn().request("fs.chmod", { ...textOrB64("path", path), mode, branch: opts.branch });
  }

  /** Moves the entry at `from` (itself: a symlink moves as a link) to `to`, in the same root
   * (/workspace or /tmp). An entry at `to` stays (error `exists`) unless `replace`. */
  async rename(from: Path, to: Path, opts: { replace?: boolean; branch?: string } = {}): Promise<void> {
    await this.conn().request("fs.rename", { ...textOrB64("from", from), ...textOrB64("to", to), replace: opts.replace || undefined, branch: opts.branch });
  }

  /** Removes a file, or a directory (`recursive` for one that is not empty). */
  async remove(path: Path, opts: { recursive?: boolean; branch?: string } = {}): Promise<void> {
    await this.conn().request("fs.remove", { ...textOrB64("path", path), recursive: opts.recursive || undefined, branch: opts.branch });
  }
}
