// The box's files: a directory of the picked branch (fs.list), the start of one file (fs.read),
// files uploaded into the directory listed (fs.write), a new directory in it (fs.mkdir), an entry
// renamed or moved (fs.rename; replacing what is there only once the user confirms) and an entry
// deleted once the user confirms (fs.remove; a directory with what it holds), through the page
// server. A name that is not UTF-8 is named by its bytes (path_b64): a path here is text, or the
// bytes of one that is not UTF-8 (a Uint8Array, which the SDK sends as path_b64).
import { bytes, el } from "./util.js";

/** How much of a file the panel shows. */
const VIEW_MAX = 256 << 10;
/** The largest file the page server relays to the box (ui/page.cpp, kMaxPageWrite). */
const UPLOAD_MAX = 16 << 20;
/** An upload's frames: the page server reads at most 1 MiB a frame. */
const UPLOAD_CHUNK = 256 << 10;

/** Whether `name` names an entry in a directory: no "/", not . or .. */
const entryName = (name) => !name.includes("/") && name !== "." && name !== "..";

const utf8 = new TextEncoder();
/** A path's bytes. */
const bytesOf = (p) => (typeof p === "string" ? utf8.encode(p) : p);
/** A path as text: bytes that are not UTF-8 with U+FFFD for each bad byte (what the page shows). */
const textOf = (p) => (typeof p === "string" ? p : new TextDecoder().decode(p));
/** Bytes as a path: text where they are UTF-8, else the bytes themselves. */
function pathOf(b) {
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(b);
  } catch {
    return b;
  }
}

/** The path of `name` (text, or the bytes of an entry's name_b64) in the directory `dir`. */
function join(dir, name) {
  if (typeof dir === "string" && typeof name === "string") return `${dir === "/" ? "" : dir}/${name}`;
  const d = bytesOf(dir);
  const head = d.length === 1 && d[0] === 0x2f ? new Uint8Array() : d;
  const tail = bytesOf(name);
  const out = new Uint8Array(head.length + 1 + tail.length);
  out.set(head);
  out[head.length] = 0x2f;
  out.set(tail, head.length + 1);
  return out;
}

/** The directory holding `path` (not "/"), or null for "/". */
function parentOf(path) {
  if (typeof path === "string") return path === "/" ? null : path.slice(0, path.lastIndexOf("/")) || "/";
  const slash = path.lastIndexOf(0x2f);
  return slash <= 0 ? "/" : pathOf(path.slice(0, slash));
}

export class Files {
  constructor(box, root, { liveBox, branchOf }) {
    this.box = box;
    this.branchOf = branchOf;
    this.path = el("input", { value: "/workspace", "data-testid": "files-path", size: 22 });
    this.list = el("ul", { class: "files", "data-testid": "files-list" });
    this.view = el("pre", { class: "file-view", "data-testid": "file-view" });
    const go = el("button", { "data-testid": "files-go", onclick: () => this.open(this.dir()), ...(liveBox ? {} : { disabled: "" }) }, "list");
    this.path.addEventListener("keydown", (e) => e.key === "Enter" && liveBox && this.open(this.dir()));
    this.upload = el("input", { type: "file", multiple: "", "data-testid": "files-upload", title: "upload into the directory listed", ...(liveBox ? {} : { disabled: "" }) });
    this.upload.addEventListener("change", () => this.send([...this.upload.files]));
    this.liveBox = liveBox;
    const mkdir = el("button", { "data-testid": "files-mkdir", onclick: () => this.mkdir(), ...(liveBox ? {} : { disabled: "" }) }, "new folder");
    root.append(liveBox ? "" : el("div", { class: "note" }, "read-only: a journal has no files"), el("div", { class: "row" }, this.path, go, mkdir, this.upload), this.list, this.view);
  }

  /** The directory listed, without a trailing slash ("/" for the root): its bytes where its name
   * is not UTF-8 and the path field still shows it. */
  dir() {
    if (this.rawDir && this.path.value === textOf(this.rawDir)) return this.rawDir;
    return this.path.value.replace(/\/+$/, "") || "/";
  }

  /** A directory named by the user (a prompt) in the directory listed, then lists it again. */
  async mkdir() {
    const dir = this.dir();
    const name = window.prompt(`new folder in ${textOf(dir)}:`);
    if (name === null || name === "") return;
    if (!entryName(name))
      return this.error(new Error(`${JSON.stringify(name)}: a folder's name, without "/" (not . or ..)`));
    const path = join(dir, name);
    try {
      await this.box.fs.mkdir(path, { branch: this.branch() });
    } catch (e) {
      return this.error(e);
    }
    await this.open(dir);
    this.view.textContent = `made ${textOf(path)}/`;
  }

  /** Deletes `path` (a directory with everything in it) once the user confirms, then lists again.
   * `shown`: the path as text. */
  async remove(path, isDir, shown = textOf(path)) {
    if (!window.confirm(`delete ${shown}${isDir ? "/ and everything in it" : ""}?`)) return;
    const dir = this.dir();
    try {
      await this.box.fs.remove(path, { recursive: isDir, branch: this.branch() });
    } catch (e) {
      return this.error(e);
    }
    await this.open(dir);
    this.view.textContent = `deleted ${shown}${isDir ? "/" : ""}`;
  }

  /** Renames `path` to a name in the directory listed, or moves it to a path from "/" (within its
   * root, /workspace or /tmp), then lists again. What is already there is replaced only once the
   * user confirms. `shown`: the path as text. */
  async rename(path, shown = textOf(path)) {
    const dir = this.dir();
    const old = shown.slice(shown.lastIndexOf("/") + 1);
    const answer = window.prompt(`rename ${shown} to (a name, or a path from /):`, old);
    if (answer === null || answer === "" || answer === old) return;
    if (!answer.startsWith("/") && !entryName(answer))
      return this.error(new Error(`${JSON.stringify(answer)}: a name without "/" (not . or ..), or a path from /`));
    const to = answer.startsWith("/") ? answer : join(dir, answer);
    const opts = { branch: this.branch() };
    try {
      await this.box.fs.rename(path, to, opts);
    } catch (e) {
      if (e.code !== "exists" || !window.confirm(`${textOf(to)} exists: replace it with ${shown}?`)) return this.error(e);
      try {
        await this.box.fs.rename(path, to, { ...opts, replace: true });
      } catch (e2) {
        return this.error(e2);
      }
    }
    await this.open(dir);
    this.view.textContent = `renamed ${shown} to ${textOf(to)}`;
  }

  /** Uploads `files` into the directory listed (the one in the path field), then lists it again. */
  async send(files) {
    const dir = this.dir();
    const done = [];
    this.upload.value = "";
    for (const f of files) {
      const path = join(dir, f.name);
      const shown = textOf(path);
      if (f.size > UPLOAD_MAX)
        return this.error(new Error(`${shown}: ${bytes(f.size)}, more than the page uploads (${bytes(UPLOAD_MAX)}): use sandboxer cp`));
      this.view.className = "file-view";
      this.view.textContent = `${shown}: uploading ${bytes(f.size)}…`;
      try {
        await this.box.fs.write(path, new Uint8Array(await f.arrayBuffer()), { branch: this.branch(), chunkSize: UPLOAD_CHUNK });
      } catch (e) {
        return this.error(e);
      }
      done.push(`${shown} (${bytes(f.size)})`);
    }
    await this.open(dir);
    this.view.textContent = `uploaded ${done.join(", ")}`;
  }

  branch() {
    return this.branchOf() || undefined;
  }

  /** Lists `path` (text, or bytes where it is not UTF-8): directories first, each a link into it;
   * files open in the view. */
  async open(path) {
    if (typeof path === "string") path = path.replace(/\/+$/, "") || "/";
    this.rawDir = typeof path === "string" ? null : path;
    this.path.value = textOf(path);
    this.view.textContent = "";
    this.view.className = "file-view";
    let entries;
    try {
      entries = await this.box.fs.list(path, { branch: this.branch() });
    } catch (e) {
      return this.error(e);
    }
    entries.sort((a, b) => (a.type === "dir") === (b.type === "dir") ? String(a.name).localeCompare(String(b.name)) : a.type === "dir" ? -1 : 1);
    // Each entry but ".." has a rename and a delete button after it.
    const item = (label, cls, fn, meta = "", full = null, isDir = false, shown = full) =>
      el("li", {}, el("button", { class: `file ${cls}`, "data-testid": `file-${label}`, onclick: fn }, label), el("span", { class: "meta" }, meta),
        ...(full ? [
          el("button", { class: "file-rename", title: "rename or move", "data-testid": `rename-${label}`, onclick: () => this.rename(full, shown) }, "✎"),
          el("button", { class: "file-delete", title: "delete", "data-testid": `delete-${label}`, onclick: () => this.remove(full, isDir, shown) }, "✕"),
        ] : []));
    const parent = parentOf(path);
    this.list.replaceChildren(
      ...(parent ? [item("..", "dir", () => this.open(parent))] : []),
      ...entries.map((e) => {
        // A name that is not UTF-8 (its bytes in name_b64) is shown with U+FFFD in place of each
        // bad byte and named by its bytes: opened, read, renamed, deleted.
        if (e.name_b64) {
          const raw = join(path, Uint8Array.from(atob(e.name_b64), (c) => c.charCodeAt(0)));
          const shown = textOf(raw);
          const isDir = e.type === "dir";
          const fn = isDir ? () => this.open(raw) : () => this.show(raw, e.type === "file" ? e.size : undefined, shown);
          return item(isDir ? `${e.name}/` : e.name, "unnamed", fn, " name not UTF-8", raw, isDir, shown);
        }
        const full = join(path, e.name);
        const isDir = e.type === "dir";
        if (isDir) return item(`${e.name}/`, "dir", () => this.open(full), "", full, true);
        // A symlink says where it points; opened, it shows what it names (inside the root).
        const meta = e.type === "file" ? bytes(e.size) : e.type === "symlink" && e.target !== undefined ? `→ ${e.target}` : e.type;
        return item(e.name, e.type, () => this.show(full, e.type === "file" ? e.size : undefined), ` ${meta}`, full);
      }),
    );
  }

  /** The first VIEW_MAX bytes of `path` as text, or what it is when it is not text. `shown`: the
   * path as text. */
  async show(path, size, shown = textOf(path)) {
    this.view.className = "file-view";
    this.view.textContent = `${shown}: reading…`;
    let data;
    try {
      data = await this.box.fs.read(path, { length: VIEW_MAX, branch: this.branch() });
    } catch (e) {
      return this.error(e);
    }
    if (data.includes(0)) {
      this.view.textContent = `${shown}: binary, ${bytes(size ?? data.length)}`;
      return;
    }
    const more = size > data.length ? `\n… the first ${bytes(data.length)} of ${bytes(size)}` : "";
    this.view.textContent = new TextDecoder().decode(data) + more;
  }

  error(e) {
    this.view.className = "file-view error";
    this.view.textContent = e.message;
  }
}
