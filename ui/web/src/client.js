// The page's protocol client, until sdk/ts (issue 20) lands in this tree: the same names
// (Box.connect, box.request, box.events, box.exec) over sandboxer.v1, talking to the page server
// that `sandboxer ui` runs (it holds the box's token; the page never sees it).

export class SandboxerError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

export class Box {
  static connect(url) {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(url, "sandboxer.v1");
      ws.onopen = () => resolve(new Box(ws));
      ws.onerror = () => reject(new SandboxerError("unavailable", `connect ${url}: failed`));
    });
  }

  constructor(ws) {
    this.ws = ws;
    this.nextId = 1;
    this.pending = new Map();
    this.eventFns = [];
    this.closeFns = [];
    ws.onmessage = (m) => this.onText(m.data);
    ws.onclose = (c) => {
      for (const p of this.pending.values()) p.reject(new SandboxerError("unavailable", `page connection closed (${c.code})`));
      this.pending.clear();
      for (const f of this.closeFns) f(c);
    };
  }

  onText(text) {
    if (typeof text !== "string") return;
    let m;
    try {
      m = JSON.parse(text);
    } catch {
      return;
    }
    if (m.seq !== undefined && m.id === undefined) {
      for (const f of this.eventFns) f(m);
      return;
    }
    const p = this.pending.get(m.id);
    if (!p) return;
    this.pending.delete(m.id);
    if (m.ok) p.resolve(m);
    else p.reject(new SandboxerError(m.error?.code ?? "failed", m.error?.message ?? JSON.stringify(m)));
  }

  /** Sends {id, op, ...fields}; resolves with the reply, rejects with its error. */
  request(op, fields = {}) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.ws.send(JSON.stringify({ ...fields, id, op }));
    });
  }

  /** Every event after `since`, then the live ones, to `onEvent`. */
  async events({ since = 0, branch } = {}, onEvent) {
    this.eventFns.push(onEvent);
    return this.request("subscribe", branch ? { since, branch } : { since });
  }

  onClose(fn) {
    this.closeFns.push(fn);
  }

  exec(argv, { proc, tty = false, stdin = false, cols, rows, branch } = {}) {
    return this.request("exec", { proc, argv, tty, stdin, cols, rows, branch });
  }
}
