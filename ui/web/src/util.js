// Small DOM helpers shared by the page's panels.
export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

export function bytes(n) {
  if (n === undefined || n === null) return "";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

/** The text of an output event: data, or data_b64 decoded. */
export function outputText(e) {
  if (typeof e.data === "string") return e.data;
  if (typeof e.data_b64 === "string") {
    const bin = atob(e.data_b64);
    const u8 = Uint8Array.from(bin, (c) => c.charCodeAt(0));
    return new TextDecoder().decode(u8);
  }
  return "";
}

// Colours and cursor moves are for the consoles; the timeline shows the text alone.
// eslint-disable-next-line no-control-regex
const ANSI = /\x1b\[[0-9;?]*[ -\/]*[@-~]|\x1b[()][A-Z0-9]|\x1b[=>]/g;

/** One line summing an event up for the timeline. */
export function summary(e) {
  switch (e.type) {
    case "proc.output":
      return `${e.proc} ${e.stream}: ${outputText(e).replace(ANSI, "").replace(/\s+$/, "")}`;
    case "proc.started":
      return `${e.proc} pid ${e.pid}: ${(e.argv || []).join(" ")}`;
    case "proc.exited":
      return `${e.proc} ${e.reason}${e.by ? " by " + e.by : ""}${e.code !== undefined ? " code " + e.code : ""}${e.signal ? " signal " + e.signal : ""}`;
    case "proc.message":
      return `${e.proc} ${JSON.stringify(e.message)}`;
    case "metrics": {
      const b = e.branches?.[e.branch] || e.box || {};
      return `cpu ${b.cpu_s ?? ""}s memory ${bytes(b.memory)} pids ${b.pids ?? ""}`;
    }
    case "limit.warning":
    case "limit.hit":
      return `${e.limit} ${e.value} of ${e.ceiling}`;
    case "checkpoint.created":
      return `${e.snapshot?.slice(0, 16)} ${e.name || ""} ${e.mode}`;
    case "fork.created":
      return `${e.n} copies of ${e.snapshot?.slice(0, 16)}: ${(e.copies || []).map((c) => c.branch).join(", ")}`;
    case "restore.done":
      return `${e.branch} from ${e.snapshot?.slice(0, 16)} (${e.mode})`;
    default: {
      const { seq, ts, type, box, branch, ...rest } = e;
      return JSON.stringify(rest).slice(0, 300);
    }
  }
}
