// The fork tree: each branch, the snapshots taken of it (name, mode, sizes, time), and the
// branches restored from each snapshot, with their state and exit reason. A click on a branch
// filters the rest of the page to it.
import { bytes, el } from "./util.js";

export class ForkTree {
  constructor(root, onPick) {
    this.root = el("div", { class: "tree", "data-testid": "fork-tree" });
    root.append(this.root);
    this.onPick = onPick;
    this.branches = new Map([["main", { name: "main", from: null, state: "running", firstProc: null }]]);
    this.snapshots = new Map();
    this.picked = "";
  }

  branch(name) {
    let b = this.branches.get(name);
    if (!b) {
      b = { name, from: null, state: "running", firstProc: null };
      this.branches.set(name, b);
    }
    return b;
  }

  onEvent(e) {
    let changed = true;
    if (e.type === "checkpoint.created") {
      this.snapshots.set(e.snapshot, { id: e.snapshot, name: e.name, mode: e.mode, sizes: e.sizes || {}, ts: e.ts, branch: e.branch });
    } else if (e.type === "snapshot.deleted") {
      const s = this.snapshots.get(e.snapshot);
      if (s) s.deleted = true;
      else changed = false;
    } else if (e.type === "snapshot.imported") {
      if (!this.snapshots.has(e.snapshot)) this.snapshots.set(e.snapshot, { id: e.snapshot, name: "imported", mode: "", sizes: {}, ts: e.ts, branch: null });
    } else if (e.type === "restore.done") {
      this.branch(e.branch).from = e.snapshot;
      this.branch(e.branch).mode = e.mode;
    } else if (e.type === "fork.created") {
      for (const c of e.copies || []) this.branch(c.branch).from = e.snapshot;
    } else if (e.type === "proc.started") {
      const b = this.branch(e.branch);
      if (!b.firstProc) b.firstProc = e.proc;
      b.state = "running";
    } else if (e.type === "proc.exited") {
      const b = this.branch(e.branch);
      if (!b.firstProc || b.firstProc === e.proc) b.state = `${e.reason}${e.code !== undefined ? " " + e.code : ""}`;
    } else if (e.type === "box.exited") {
      for (const b of this.branches.values()) if (b.state === "running") b.state = "ended";
    } else {
      changed = false;
    }
    if (changed) this.renderSoon();
  }

  renderSoon() {
    if (this.pending) return;
    this.pending = setTimeout(() => {
      this.pending = null;
      this.render();
    }, 100);
  }

  node(b) {
    const li = el("li", {});
    li.append(el("button", { class: `branch${this.picked === b.name ? " picked" : ""}`, "data-testid": `branch-${b.name}`, "data-branch": b.name,
      onclick: () => this.pick(this.picked === b.name ? "" : b.name) }, `${b.name}`), el("span", { class: "state" }, ` ${b.state}`));
    const snaps = [...this.snapshots.values()].filter((s) => s.branch === b.name);
    if (snaps.length) {
      const ul = el("ul", {});
      for (const s of snaps) ul.append(this.snapNode(s));
      li.append(ul);
    }
    return li;
  }

  snapNode(s) {
    // A deleted snapshot stays in the tree, struck through, with the branches restored from it.
    const li = el("li", { class: `snapshot${s.deleted ? " deleted" : ""}`, "data-testid": `snapshot-${s.id.slice(0, 12)}`, "data-snapshot": s.id },
      el("span", { class: "snap" }, `◆ ${s.name || s.id.slice(0, 12)}`),
      el("span", { class: "meta" }, ` ${s.mode} ${bytes(s.sizes.compressed ?? s.sizes.raw)} ${s.ts?.slice(11, 19) ?? ""}${s.deleted ? " deleted" : ""}`));
    const kids = [...this.branches.values()].filter((b) => b.from === s.id);
    if (kids.length) {
      const ul = el("ul", {});
      for (const k of kids) ul.append(this.node(k));
      li.append(ul);
    }
    return li;
  }

  pick(name) {
    this.picked = name;
    this.render();
    this.onPick(name);
  }

  render() {
    const roots = [...this.branches.values()].filter((b) => !b.from || !this.snapshots.has(b.from));
    const ul = el("ul", {});
    for (const b of roots) ul.append(this.node(b));
    const orphans = [...this.snapshots.values()].filter((s) => !s.branch || !this.branches.has(s.branch));
    for (const s of orphans) ul.append(this.snapNode(s));
    this.root.replaceChildren(ul);
  }

  /** The snapshots that can still be forked or deleted, oldest first. */
  snapshotIds() {
    return [...this.snapshots.values()].filter((s) => !s.deleted);
  }
}
