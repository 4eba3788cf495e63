// Actions on a live box, each one request of the same API the CLI uses, its reply or error shown
// as the box gave it. A replayed journal shows them disabled, and the server refuses them too.
import { bytes, el } from "./util.js";

let terminals = 0;

export class Actions {
  constructor(box, root, { tree, consoles, liveBox, branchOf }) {
    this.box = box;
    this.tree = tree;
    this.consoles = consoles;
    this.branchOf = branchOf;
    this.result = el("pre", { class: "result", "data-testid": "action-result" });
    const name = el("input", { placeholder: "name", "data-testid": "checkpoint-name", size: 10 });
    this.snapSel = el("select", { "data-testid": "fork-snapshot" });
    const n = el("input", { type: "number", min: 1, value: 2, "data-testid": "fork-n", style: "width:4em" });
    const proc = el("input", { placeholder: "proc", "data-testid": "signal-proc", size: 8 });
    const sig = el("select", { "data-testid": "signal-name" }, ...["TERM", "INT", "HUP", "KILL", "USR1"].map((s) => el("option", { value: s }, s)));
    const cmd = el("input", { value: "/bin/sh", "data-testid": "terminal-cmd", size: 10 });
    const importer = el("input", { type: "file", accept: ".zst", "data-testid": "import-snapshot", title: "a snapshot's archive (sandboxer export, or a download)", ...(liveBox ? {} : { disabled: "" }) });
    importer.addEventListener("change", () => this.importFile(importer));
    const b = (label, id, fn) => el("button", { "data-testid": id, onclick: fn, ...(liveBox ? {} : { disabled: "" }) }, label);
    root.append(
      liveBox ? "" : el("div", { class: "note", "data-testid": "read-only" }, "read-only: a journal replayed from disk"),
      el("div", { class: "row" }, name, b("checkpoint", "do-checkpoint", () => this.run("checkpoint", () => box.checkpoint(name.value || undefined, { branch: this.branchOf() || undefined })))),
      el("div", { class: "row" }, this.snapSel, " n ", n, b("fork", "do-fork", () => this.run("fork", () => box.fork(this.snapSel.value, Number(n.value)))),
        b("delete…", "do-delete-snapshot", () => {
          const id = this.snapSel.value;
          if (id && confirm(`Delete snapshot ${id}? Branches restored from it go on; it can no longer be forked.`))
            this.run("snapshot.delete", () => box.deleteSnapshot(id));
        }),
        b("download", "do-download-snapshot", () => this.download(this.snapSel.value))),
      el("div", { class: "row" }, "import a snapshot ", importer),
      el("div", { class: "row" }, proc, sig, b("signal", "do-signal", () => this.run("signal", () => box.signal(proc.value, sig.value)))),
      el("div", { class: "row" }, cmd, b("terminal", "do-terminal", () => this.terminal(cmd.value))),
      el("div", { class: "row" }, b("shutdown…", "do-shutdown", () => {
        if (confirm("Shut the box down? Every process of every branch is ended.")) this.run("shutdown", () => box.shutdown("5s"));
      })),
      this.result,
    );
  }

  /** Keeps the snapshot list in step with the fork tree. */
  refreshSnapshots() {
    const snaps = this.tree.snapshotIds();
    const shown = [...this.snapSel.options].map((o) => o.value);
    if (snaps.length === shown.length && snaps.every((s, i) => s.id === shown[i])) return;
    this.snapSel.replaceChildren(...snaps.map((s) => el("option", { value: s.id }, s.name || s.id.slice(0, 12))));
    if (snaps.length) this.snapSel.value = snaps[snaps.length - 1].id;
  }

  /** Saves snapshot `id`'s archive through the browser: the page server streams it from the box
   * (GET snapshot/<id>.tar.zst, ui/snapshot-http.cpp); where it cannot, the browser's download fails. */
  download(id) {
    if (!id) return;
    const a = el("a", { href: `snapshot/${id}.tar.zst`, download: `${id}.tar.zst`, style: "display:none" });
    document.body.append(a);
    a.click();
    a.remove();
    this.result.className = "result";
    this.result.textContent = `download of ${id}.tar.zst started: the browser saves it`;
  }

  /** Sends the archive picked in `input` into the box (POST snapshot/import: the page server feeds
   * it to snapshot.import as the browser reads it from disk) and shows the box's reply. */
  async importFile(input) {
    const f = input.files[0];
    input.value = "";
    if (!f) return;
    this.run("snapshot.import", async () => {
      this.result.textContent = `snapshot.import: sending ${f.name} (${bytes(f.size)})…`;
      const r = await fetch("snapshot/import", { method: "POST", body: f, headers: { "Content-Type": "application/zstd" } });
      const text = (await r.text()).trim();
      if (!r.ok) throw Object.assign(new Error(text), { code: String(r.status) });
      return JSON.parse(text);
    });
  }

  /** Runs one call of the client and shows its reply, or its error as the box gave it. */
  async run(op, call) {
    this.result.textContent = `${op}…`;
    this.result.className = "result";
    try {
      const r = (await call()) ?? {};
      const { id, ok, ...rest } = r;
      this.result.textContent = `${op}: ok ${JSON.stringify(rest, null, 1)}`;
      return r;
    } catch (e) {
      // sdk/ts's errors read "<op>: <code>: <what>".
      this.result.textContent = e.code && e.message.startsWith(`${op}:`) ? e.message : `${op}: ${e.code ?? "failed"}: ${e.message}`;
      this.result.className = "result error";
      return null;
    }
  }

  async terminal(command) {
    const proc = `ui-term-${Date.now().toString(36)}-${++terminals}`;
    const branch = this.branchOf() || "main";
    const c = this.consoles.get({ branch, proc }, { pty: true, input: true, focus: true });
    c.term.onData((data) => this.box.stdin(proc, data).catch(() => {}));
    c.term.onResize(({ cols, rows }) => this.box.resize(proc, cols, rows).catch(() => {}));
    // The exec request itself, not box.exec(): the pty's output reaches the console through the
    // page's one event stream, and a process handle would follow it on a second one.
    const argv = command.split(/\s+/).filter(Boolean);
    const sent = { cols: c.term.cols, rows: c.term.rows };
    const r = await this.run("exec", () => this.box.request("exec", { proc, argv, tty: true, stdin: true, ...sent, branch }));
    if (!r) return;
    // The terminal fitted to its pane after the request went: its resize reached the box before the
    // process existed, and was refused. Once more, ahead of anything typed.
    if (c.term.cols !== sent.cols || c.term.rows !== sent.rows) this.box.resize(proc, c.term.cols, c.term.rows).catch(() => {});
    c.term.focus();
  }
}
