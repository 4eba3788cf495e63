// The event timeline: the filtered list lives in the page server (events.range); the page holds
// only the rows near the view, in pages of PAGE rows, so 100k+ events scroll as fast as 100.
import { el, summary } from "./util.js";

const ROW = 20;
const PAGE = 200;
const KEEP_PAGES = 12;

export class Timeline {
  constructor(box, root, onSelect) {
    this.box = box;
    this.filter = { branch: "", proc: "", types: [] };
    this.total = 0;
    this.pages = new Map();
    this.loading = new Set();
    this.again = new Set();
    this.onSelect = onSelect;
    this.scroller = el("div", { class: "tl-scroll", "data-testid": "timeline" });
    this.spacer = el("div", { class: "tl-spacer" });
    this.rows = el("div", { class: "tl-rows" });
    this.scroller.append(this.spacer, this.rows);
    this.scroller.addEventListener("scroll", () => this.render());
    this.count = el("span", { class: "tl-count", "data-testid": "timeline-count" });
    this.typeInput = el("input", { placeholder: "types (comma-separated)", "data-testid": "filter-type", size: 24 });
    this.typeInput.addEventListener("change", () => this.setFilter({ types: this.typeInput.value.split(",").map((s) => s.trim()).filter(Boolean) }));
    this.procInput = el("input", { placeholder: "proc", "data-testid": "filter-proc", size: 8 });
    this.procInput.addEventListener("change", () => this.setFilter({ proc: this.procInput.value.trim() }));
    this.seqInput = el("input", { placeholder: "seq", "data-testid": "jump-seq", size: 8 });
    this.seqInput.addEventListener("change", () => this.jump(Number(this.seqInput.value)).catch(() => {}));
    this.follow = el("input", { type: "checkbox", checked: "", "data-testid": "follow" });
    root.append(
      el("div", { class: "tl-bar" }, this.typeInput, this.procInput, el("label", {}, "jump to ", this.seqInput),
        el("label", {}, this.follow, " follow"), this.count),
      this.scroller,
    );
    this.refreshSoon();
  }

  setFilter(f) {
    Object.assign(this.filter, f);
    // Pages still on their way were asked for under the old filter: they are dropped on arrival.
    this.generation = (this.generation ?? 0) + 1;
    this.pages.clear();
    this.loading.clear();
    this.again.clear();
    this.refresh().catch(() => {});
  }

  /** Asks the server for the total again (new events, or another filter), then redraws. */
  refreshSoon() {
    if (this.timer) return;
    this.timer = setTimeout(() => {
      this.timer = null;
      // A lost page server is shown by the status line; the rows on screen stay.
      this.refresh().catch(() => {});
    }, 250);
  }

  async refresh() {
    const r = await this.box.request("events.range", { ...this.filter, from: 0, count: 0 });
    const grew = r.total !== this.total;
    this.total = r.total;
    // The last page may have grown: fetch it again.
    const last = Math.floor(Math.max(0, this.total - 1) / PAGE);
    this.refetch(last);
    this.refetch(last - 1);
    this.spacer.style.height = `${this.total * ROW}px`;
    this.count.textContent = `${this.total} events`;
    if (grew && this.follow.checked) this.scroller.scrollTop = this.total * ROW;
    this.render();
  }

  async jump(seq) {
    if (!Number.isFinite(seq)) return;
    const r = await this.box.request("events.find", { ...this.filter, seq });
    this.follow.checked = false;
    this.scroller.scrollTop = Math.max(0, r.index * ROW - 2 * ROW);
    this.highlight = seq;
    this.render();
  }

  // A page that may have grown is asked for again; the rows it had stay drawn until the answer
  // comes (dropped first, the timeline went blank at every new event). One asked for already may
  // have been answered before the new events: asked again once it is.
  refetch(p) {
    if (p < 0) return;
    if (this.loading.has(p)) this.again.add(p);
    else if (this.pages.has(p)) this.loadPage(p).catch(() => {});
  }

  async loadPage(p) {
    if (this.loading.has(p)) return;
    this.loading.add(p);
    const generation = this.generation;
    try {
      const r = await this.box.request("events.range", { ...this.filter, from: p * PAGE, count: PAGE });
      if (generation !== this.generation) return;
      this.pages.set(p, r.events);
      while (this.pages.size > KEEP_PAGES) this.pages.delete(this.pages.keys().next().value);
    } finally {
      if (generation === this.generation) this.loading.delete(p);
    }
    if (this.again.delete(p)) this.loadPage(p).catch(() => {});
    this.render();
  }

  render() {
    const first = Math.floor(this.scroller.scrollTop / ROW);
    const n = Math.ceil(this.scroller.clientHeight / ROW) + 2;
    const last = Math.min(this.total, first + n);
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) {
      const p = Math.floor(i / PAGE);
      const page = this.pages.get(p);
      if (!page) {
        this.loadPage(p).catch(() => {});
        continue;
      }
      const e = page[i - p * PAGE];
      if (!e) continue;
      const row = el("div", { class: `tl-row t-${e.type.replace(/\./g, "-")}${e.seq === this.highlight ? " hl" : ""}`, "data-seq": e.seq },
        el("span", { class: "seq" }, String(e.seq)), el("span", { class: "ts" }, e.ts.slice(11, 23)),
        el("span", { class: "br" }, e.branch), el("span", { class: "ty" }, e.type), el("span", { class: "sm" }, summary(e)));
      row.style.top = `${i * ROW}px`;
      row.addEventListener("click", () => this.onSelect(e));
      frag.append(row);
    }
    this.rows.replaceChildren(frag);
  }
}
