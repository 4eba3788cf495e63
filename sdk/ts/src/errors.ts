/** The one error type of the SDK and its few refinements (docs/errors.md: a code and a message
 * that names what was wrong). */

export type Json = null | boolean | number | string | Json[] | { [k: string]: Json };
export type JsonObject = { [k: string]: Json };

/** An operation failed: `code` is the server's error code (or a client-side one such as
 * `connection_closed`, `unauthorized`, `protocol`), `message` says what was wrong. */
export class SandboxerError extends Error {
  readonly code: string;
  readonly op: string | undefined;
  readonly requestId: number | undefined;
  /** The error object's fields other than `code` and `message`. */
  readonly details: JsonObject;
  /** The whole error reply (e.g. `state` of a failed exec). */
  readonly reply: JsonObject;
  /** What was wrong, without the op and code prefix of `message`. */
  readonly detail: string;

  constructor(code: string, detail: string, opts: { op?: string; requestId?: number; details?: JsonObject; reply?: JsonObject } = {}) {
    super(`${opts.op ? opts.op + ": " : ""}${code}: ${detail}`);
    this.name = "SandboxerError";
    this.code = code;
    this.detail = detail;
    this.op = opts.op;
    this.requestId = opts.requestId;
    this.details = opts.details ?? {};
    this.reply = opts.reply ?? {};
  }

  /** The error of a `{"ok": false, "error": {...}}` reply. */
  static fromReply(reply: JsonObject, op?: string): SandboxerError {
    const err = reply.error;
    if (err === null || typeof err !== "object" || Array.isArray(err)) {
      return new ProtocolError(`error reply without an error object: ${JSON.stringify(reply).slice(0, 300)}`, op);
    }
    const details: JsonObject = {};
    for (const [k, v] of Object.entries(err)) if (k !== "code" && k !== "message") details[k] = v;
    return new SandboxerError(String(err.code ?? "unknown"), String(err.message ?? ""), {
      op,
      requestId: typeof reply.id === "number" ? reply.id : undefined,
      details,
      reply,
    });
  }
}

/** The server refused the token (HTTP 401, or close code 4401 after an auth frame). */
export class AuthError extends SandboxerError {
  constructor(detail: string) {
    super("unauthorized", detail);
    this.name = "AuthError";
  }
}

/** The connection closed while a request waited, or an event stream could not reconnect.
 * `closeCode` and `closeReason` are the WebSocket close frame's (null: no close frame). */
export class ConnectionLost extends SandboxerError {
  readonly closeCode: number | null;
  readonly closeReason: string;
  constructor(detail: string, closeCode: number | null = null, closeReason = "") {
    super("connection_closed", detail);
    this.name = "ConnectionLost";
    this.closeCode = closeCode;
    this.closeReason = closeReason;
  }
}

/** The server sent something this client cannot make sense of. */
export class ProtocolError extends SandboxerError {
  constructor(detail: string, op?: string) {
    super("protocol", detail, { op });
    this.name = "ProtocolError";
  }
}
