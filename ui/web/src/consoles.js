// A console per process (xterm.js: ANSI colours, a pty shown as the terminal it is) and its
// proc.message JSON shown structured beside it.
import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import { el, outputText } from "./util.js";

export class Consoles {
  constructor(root) {
    this.tabs = el("div", { class: "tabs", "data-testid": "console-tabs" });
    this.body = el("div", { class: "console-body" });
    root.append(this.tabs, this.body);
    this.procs = new Map();
    this.current = null;
  }

  key(e) {
    return `${e.branch}/${e.proc}`;
  }

  get(e, opts = {}) {
    const k = this.key(e);
    let c = this.procs.get(k);
    if (c) return c;
    const pane = el("div", { class: "console", "data-testid": `console-${k}`, "data-proc": e.proc, "data-branch": e.branch });
    const termDiv = el("div", { class: "term" });
    const messages = el("div", { class: "messages", "data-testid": `messages-${k}` });
    pane.append(termDiv, messages);
    // Pipes carry "\n" alone; a pty already sends "\r\n".
    const term = new Terminal({ convertEol: !opts.pty, scrollback: 5000, fontSize: 12, rows: 18, cols: 100, disableStdin: !opts.input });
    term.open(termDiv);
    if (opts.input) {
      // A terminal of the page's own follows its pane's size; the pty is resized to match
      // (term.onResize, in actions.js).
      const fit = new FitAddon();
      term.loadAddon(fit);
      const refit = () => {
        try {
          if (!pane.hidden) fit.fit();
        } catch {
          // Not laid out yet: the next resize fits it.
        }
      };
      window.addEventListener("resize", refit);
      setTimeout(refit, 0);
    }
    const tab = el("button", { class: "tab", "data-testid": `tab-${k}`, onclick: () => this.show(k) }, k);
    this.tabs.append(tab);
    this.body.append(pane);
    c = { k, branch: e.branch, proc: e.proc, pane, term, tab, messages, status: "" };
    this.procs.set(k, c);
    if (!this.current || opts.focus) this.show(k);
    return c;
  }

  all() {
    return [...this.procs.values()];
  }

  show(k) {
    for (const c of this.procs.values()) {
      c.pane.hidden = c.k !== k;
      c.tab.classList.toggle("active", c.k === k);
    }
    this.current = k;
  }

  /** Shows only the consoles of `branch` ("" for every branch). */
  filter(branch) {
    for (const c of this.procs.values()) c.tab.hidden = branch !== "" && !c.k.startsWith(`${branch}/`);
  }

  flushSoon() {
    if (this.flushing) return;
    this.flushing = setTimeout(() => {
      this.flushing = null;
      for (const c of this.procs.values()) {
        if (!c.pending) continue;
        c.term.write(c.pending);
        c.pending = "";
      }
    }, 30);
  }

  onEvent(e) {
    if (!e.proc) return;
    if (e.type === "proc.output") {
      // Written in one piece per console and frame: a journal of 100k lines replays in a
      // moment instead of one terminal write per event.
      const c = this.get(e, { pty: e.stream === "pty" });
      c.pending = (c.pending ?? "") + outputText(e);
      this.flushSoon();
    } else if (e.type === "proc.started") {
      this.get(e);
    } else if (e.type === "proc.message") {
      const c = this.get(e);
      const d = el("details", { class: "message", open: "" }, el("summary", {}, `#${e.seq} ${e.message?.type ?? "message"}`),
        el("pre", {}, JSON.stringify(e.message, null, 2)));
      c.messages.append(d);
    } else if (e.type === "proc.exited") {
      const c = this.get(e);
      c.tab.textContent = `${c.k} (${e.reason}${e.by ? " by " + e.by : ""}${e.code !== undefined ? " " + e.code : ""})`;
      c.tab.classList.add("exited");
    }
  }
}
