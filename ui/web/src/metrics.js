// Metrics over time per branch (uPlot): CPU, memory with its ceiling, pids and disk, from the
// `metrics` events; limit.warning and limit.hit drawn as marks on the time axis.
import uPlot from "uplot";
import { el } from "./util.js";

const SERIES = [
  { key: "cpu", label: "CPU %" },
  { key: "memory", label: "memory MiB" },
  { key: "pids", label: "pids" },
  { key: "disk", label: "disk MiB" },
];

export class Metrics {
  constructor(root) {
    this.root = root;
    this.branch = "main";
    this.data = new Map();
    this.marks = [];
    this.ceiling = null;
    this.plots = [];
    this.select = el("select", { "data-testid": "metrics-branch", onchange: () => this.show(this.select.value) });
    this.points = el("span", { "data-testid": "metrics-points" }, "0");
    root.append(el("div", { class: "bar" }, "branch ", this.select, " points ", this.points));
    this.charts = el("div", { class: "charts", "data-testid": "metrics-charts" });
    root.append(this.charts);
  }

  series(branch) {
    let s = this.data.get(branch);
    if (!s) {
      s = { t: [], cpu: [], memory: [], pids: [], disk: [], ceiling: [], lastCpu: null };
      this.data.set(branch, s);
      this.select.append(el("option", { value: branch }, branch));
      if (this.data.size === 1) this.show(branch);
    }
    return s;
  }

  onEvent(e) {
    if (e.type === "limit.warning" || e.type === "limit.hit") {
      this.marks.push({ t: Date.parse(e.ts) / 1000, branch: e.branch, hit: e.type === "limit.hit", label: `${e.limit}` });
      if (e.limit === "memory" && e.ceiling) this.ceiling = e.ceiling;
      this.redrawSoon();
      return;
    }
    if (e.type !== "metrics" || !e.branches) return;
    const t = Date.parse(e.ts) / 1000;
    for (const [b, m] of Object.entries(e.branches)) {
      const s = this.series(b);
      const cpu = s.lastCpu ? (100 * (m.cpu_s - s.lastCpu.v)) / Math.max(1e-3, t - s.lastCpu.t) : 0;
      s.lastCpu = { t, v: m.cpu_s };
      s.t.push(t);
      s.cpu.push(Math.max(0, cpu));
      s.memory.push(m.memory / 1048576);
      s.pids.push(m.pids);
      s.disk.push((m.disk ?? 0) / 1048576);
      const ceil = m.memory_max ?? m.memory_limit ?? this.ceiling;
      s.ceiling.push(ceil ? ceil / 1048576 : null);
    }
    this.redrawSoon();
  }

  redrawSoon() {
    if (this.pending) return;
    this.pending = requestAnimationFrame(() => {
      this.pending = null;
      this.update();
    });
  }

  show(branch) {
    if (![...this.select.options].some((o) => o.value === branch)) this.select.append(el("option", { value: branch }, branch));
    this.branch = branch;
    this.select.value = branch;
    this.charts.replaceChildren();
    this.plots = [];
    for (const sdef of SERIES) {
      const holder = el("div", { class: "chart", "data-testid": `chart-${sdef.key}` });
      this.charts.append(holder);
      const series = [{}, { label: sdef.label, stroke: "#2a7ae2", width: 1.5 }];
      if (sdef.key === "memory") series.push({ label: "ceiling", stroke: "#d33", dash: [6, 4] });
      const marks = this.marks;
      const opts = {
        width: 420,
        height: 150,
        title: sdef.label,
        series,
        hooks: {
          draw: [
            (u) => {
              // limit.warning (orange) and limit.hit (red) as vertical lines.
              const { ctx } = u;
              for (const m of marks) {
                if (m.branch !== this.branch) continue;
                const x = u.valToPos(m.t, "x", true);
                ctx.strokeStyle = m.hit ? "#d00" : "#e90";
                ctx.beginPath();
                ctx.moveTo(x, u.bbox.top);
                ctx.lineTo(x, u.bbox.top + u.bbox.height);
                ctx.stroke();
              }
            },
          ],
        },
      };
      this.plots.push({ key: sdef.key, plot: new uPlot(opts, this.arrays(sdef.key), holder) });
    }
  }

  arrays(key) {
    const s = this.data.get(this.branch) || { t: [], [key]: [], ceiling: [] };
    return key === "memory" ? [s.t, s.memory, s.ceiling] : [s.t, s[key]];
  }

  update() {
    for (const p of this.plots) p.plot.setData(this.arrays(p.key));
    this.points.textContent = String(this.data.get(this.branch)?.t.length ?? 0);
    // What the canvas shows, for people with a screen reader and for the tests.
    this.charts.dataset.marks = String(this.marks.filter((m) => m.branch === this.branch).length);
    this.charts.dataset.ceiling = this.ceiling ? String(this.ceiling) : "";
  }
}
