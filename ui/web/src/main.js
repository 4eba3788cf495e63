// The page `sandboxer ui` serves: one box, live or replayed from its journal. Every panel is fed
// by the one event stream (subscribe since 0) except the timeline, which asks the page server
// for ranges of its filtered list.
import "@xterm/xterm/css/xterm.css";
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { Actions } from "./actions.js";
import { Box } from "../../../sdk/ts/src/index.ts";
import { Consoles } from "./consoles.js";
import { Files } from "./files.js";
import { Metrics } from "./metrics.js";
import { Timeline } from "./timeline.js";
import { ForkTree } from "./tree.js";
import { el } from "./util.js";

// What the tree, the metrics and the console list are made of.
const HISTORY_TYPES = ["box.started", "box.exited", "proc.started", "proc.exited", "proc.message", "metrics", "limit.warning", "limit.hit",
  "checkpoint.created", "checkpoint.failed", "restore.done", "restore.failed", "fork.created", "snapshot.imported", "snapshot.deleted"];
// The output events a console loads from history (the timeline has every one).
const CONSOLE_TAIL = 2000;

async function main() {
  const app = document.getElementById("app");
  const status = el("span", { class: "status", "data-testid": "status" }, "connecting");
  const header = el("header", {}, el("b", {}, "sandboxer"), " ", status);
  const panel = (title, id) => {
    const body = el("div", { class: "body" });
    const section = el("section", { class: `panel ${id}`, "data-testid": `panel-${id}` }, el("h2", {}, title), body);
    return { section, body };
  };
  const tree = panel("fork tree", "tree");
  const actions = panel("actions", "actions");
  const files = panel("files", "files");
  const timeline = panel("events", "timeline");
  const detail = el("pre", { class: "detail", "data-testid": "event-detail" });
  timeline.body.append(detail);
  const consoles = panel("consoles", "consoles");
  const metrics = panel("metrics", "metrics");
  app.append(header, el("main", {}, el("div", { class: "left" }, tree.section, actions.section, files.section), timeline.section, consoles.section, metrics.section));

  const wsUrl = new URL("ws", location.href);
  wsUrl.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  // The page's session is the secret in its address, checked by the page server on this
  // WebSocket; the client's auth frame is required by its API but carries nothing: the box's
  // token stays in the CLI.
  const box = await Box.connect(wsUrl.href, { token: "page", authFrame: true });
  const info = await box.request("ui.info");
  document.title = `sandboxer: ${info.source}`;
  const showStatus = (i) => {
    status.textContent = `${i.mode === "live" ? "live" : "replay (read-only)"} · ${i.source} · ${i.box}${i.ended ? " · ended" : ""}`;
  };
  showStatus(info);

  let picked = "";
  const tl = new Timeline(box, timeline.body, (e) => (detail.textContent = JSON.stringify(e, null, 2)));
  const cons = new Consoles(consoles.body);
  const met = new Metrics(metrics.body);
  const ft = new ForkTree(tree.body, (branch) => {
    picked = branch;
    tl.setFilter({ branch });
    cons.filter(branch);
    if (branch) met.show(branch);
  });
  const act = new Actions(box, actions.body, { tree: ft, consoles: cons, liveBox: info.mode === "live", branchOf: () => picked });
  new Files(box, files.body, { liveBox: info.mode === "live", branchOf: () => picked });
  ft.render();

  setInterval(() => box.request("ui.info").then(showStatus, () => (status.textContent = "disconnected from the page server")), 2000);

  // History first, by range and by type, so a 100k-event journal costs the page a few replies
  // rather than 100k frames: the tree, metrics and process list whole, each console's tail.
  // Then the live stream from where that history ended, with no gap and no duplicate.
  const upTo = info.last_seq;
  const feed = (e) => {
    cons.onEvent(e);
    met.onEvent(e);
    ft.onEvent(e);
    if (["checkpoint.created", "snapshot.imported", "snapshot.deleted"].includes(e.type)) act.refreshSnapshots();
  };
  const fetchAll = async (filter, fn) => {
    for (let from = 0; ; ) {
      const r = await box.request("events.range", { ...filter, from, count: 2000 });
      for (const e of r.events) if (e.seq <= upTo) fn(e);
      from += r.events.length;
      if (r.events.length === 0 || from >= r.total || r.events[r.events.length - 1].seq > upTo) break;
    }
  };
  for (const p of (await box.request("events.procs")).procs) cons.get(p);
  await fetchAll({ types: HISTORY_TYPES }, feed);
  for (const c of cons.all()) {
    const filter = { branch: c.branch, proc: c.proc, types: ["proc.output"] };
    const { total } = await box.request("events.range", { ...filter, count: 0 });
    const from = Math.max(0, total - CONSOLE_TAIL);
    if (from > 0) c.term.write(`\x1b[2m[${from} earlier output events: see the timeline]\x1b[0m\r\n`);
    const r = await box.request("events.range", { ...filter, from, count: CONSOLE_TAIL });
    for (const e of r.events) if (e.seq <= upTo) cons.onEvent(e);
  }
  tl.refreshSoon();

  try {
    for await (const e of box.events({ since: upTo })) {
      feed(e);
      tl.refreshSoon();
    }
  } catch (e) {
    // The page server went away (`sandboxer ui` ended): what is on the page stays readable.
    status.textContent = `disconnected from the page server: ${e.message}`;
  }
}

main().catch((e) => {
  document.body.append(el("pre", { class: "fatal", "data-testid": "fatal" }, String(e.message || e)));
});
