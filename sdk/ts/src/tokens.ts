/** Node only: where the box token comes from: an explicit argument, a token file,
 * SANDBOXER_TOKEN, or the CLI's token store (one file per URL, mode 0600, under
 * `$XDG_STATE_HOME/sandboxer/tokens/`), as sdk/python and the CLI find it. */
import { chmodSync, closeSync, existsSync, mkdirSync, openSync, readFileSync, statSync, writeSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import { AuthError } from "./errors.js";

/** `$XDG_STATE_HOME`, or `~/.local/state` when it is unset or empty. */
export function stateHome(): string {
  return process.env.XDG_STATE_HOME || join(homedir(), ".local", "state");
}

/** The URL as the CLI keys it: no fragment, scheme and host lower-cased, no trailing '/' on the
 * path. */
function normalized(url: string): string {
  url = url.replace(/[ \n]+$/, "").split("#", 1)[0]!;
  const i = url.indexOf("://");
  if (i < 0) return url;
  let hostEnd = url.length;
  for (const ch of ["/", "?"]) {
    const j = url.indexOf(ch, i + 3);
    if (j >= 0) hostEnd = Math.min(hostEnd, j);
  }
  const q = url.indexOf("?", hostEnd);
  const path = url.slice(hostEnd, q >= 0 ? q : url.length).replace(/\/+$/, "");
  return url.slice(0, hostEnd).toLowerCase() + path + (q >= 0 ? url.slice(q) : "");
}

/** The token store's file name for `url`, as the CLI makes it: the normalized URL with every
 * byte other than a letter, digit, '.', '-', '_' or '~' percent-encoded
 * (`ws://127.0.0.1:7000/` -> `ws%3A%2F%2F127.0.0.1%3A7000`). */
export function tokenKey(url: string): string {
  let out = "";
  for (const b of new TextEncoder().encode(normalized(url))) {
    const c = String.fromCharCode(b);
    out += /[A-Za-z0-9.\-_~]/.test(c) ? c : "%" + b.toString(16).toUpperCase().padStart(2, "0");
  }
  return out;
}

/** The token store's file for `url`. */
export function tokenPath(url: string): string {
  return join(stateHome(), "sandboxer", "tokens", tokenKey(url));
}

/** A token file's contents without surrounding whitespace; an empty file is an error. */
export function readTokenFile(path: string): string {
  const tok = readFileSync(path, "utf8").trim();
  if (!tok) throw new AuthError(`token file ${path} is empty`);
  return tok;
}

/** The token for `url`: `token`, else `tokenFile`, else SANDBOXER_TOKEN, else the token store.
 * Throws AuthError naming every place it looked when none has one. */
export function resolveToken(url: string, token?: string, tokenFile?: string): string {
  if (token) return token;
  if (tokenFile) return readTokenFile(tokenFile);
  const env = process.env.SANDBOXER_TOKEN;
  if (env && env.trim()) return env.trim();
  const p = tokenPath(url);
  if (existsSync(p) && statSync(p).isFile()) return readTokenFile(p);
  throw new AuthError(`no token for ${url}: pass {token}, set SANDBOXER_TOKEN, or store one in ${p}`);
}

/** Saves `token` for `url` in the token store (directory 0700, file 0600); returns the path. */
export function storeToken(url: string, token: string): string {
  const p = tokenPath(url);
  mkdirSync(join(stateHome(), "sandboxer", "tokens"), { recursive: true, mode: 0o700 });
  const fd = openSync(p, "w", 0o600);
  try {
    writeSync(fd, token + "\n");
  } finally {
    closeSync(fd);
  }
  chmodSync(p, 0o600);
  return p;
}
