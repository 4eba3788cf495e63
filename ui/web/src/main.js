// The page `sandboxer ui` serves: one box, live or replayed from its journal. Every panel is fed
// by the one event stream (subscribe since 0) except the timeline, which asks the page server
// for ranges of its filtered list.
import "@xterm/xterm/css/xterm.css";
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { Actions } from "./actions.js";
import { Box } from "./client.js";
import { Consoles } from "./consoles.js";
import { Metrics } from "./metrics.js";
import { Timeline } from "./timeline.js";
import { ForkTree } from "./tree.js";
import { el } from "./util.js";

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
  const timeline = panel("events", "timeline");
  const detail = el("pre", { class: "detail", "data-testid": "event-detail" });
  timeline.body.append(detail);
  const consoles = panel("consoles", "consoles");
  const metrics = panel("metrics", "metrics");
  app.append(header, el("main", {}, el("div", { class: "left" }, tree.section, actions.section), timeline.section, consoles.section, metrics.section));

  const wsUrl = new URL("ws", location.href);
  wsUrl.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const box = await Box.connect(wsUrl.href);
  const info = await box.request("ui.info");
  document.title = `sandboxer: ${info.source}`;
  const showStatus = (i) => {
    status.textContent = `${i.mode === "live" ? "live" : "replay (read-only)"} · ${i.source} · ${i.box}${i.ended ? " · ended" : ""}`;
  };
  showStatus(info);
  box.onClose(() => (status.textContent = "disconnected from the page server"));

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
  ft.render();

  await box.events({ since: 0 }, (e) => {
    cons.onEvent(e);
    met.onEvent(e);
    ft.onEvent(e);
    if (e.type === "checkpoint.created" || e.type === "snapshot.imported") act.refreshSnapshots();
    tl.refreshSoon();
  });
  setInterval(async () => showStatus(await box.request("ui.info")), 2000);
}

main().catch((e) => {
  document.body.append(el("pre", { class: "fatal", "data-testid": "fatal" }, String(e.message || e)));
});
