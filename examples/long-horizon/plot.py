#!/usr/bin/env python3
"""Draws a box's resource use over time from the `metrics` events of its journal, as an SVG.

    python3 plot.py STATE_DIR out.svg        (reads the journal through `sandboxer log --json`)

Two panels: memory (MiB) and CPU (cores, from the cpu_s deltas), against seconds since the first
sample. Standard library only; prints a one-line summary."""
import datetime
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("SANDBOXER_CLI", str(ROOT / "build" / "bin" / "sandboxer"))


def samples(state_dir):
    out = subprocess.run([CLI, "log", str(state_dir), "--json"], check=True, capture_output=True, text=True).stdout
    pts = []
    for line in out.splitlines():
        e = json.loads(line)
        if e["type"] != "metrics":
            continue
        t = datetime.datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
        b = e.get("branches", {}).get("main") or {}
        pts.append((t, b.get("memory", 0), b.get("cpu_s", 0.0)))
    return pts


def polyline(xs, ys, x0, y0, w, h, color):
    if not xs:
        return ""
    xmax = max(xs) or 1
    ymax = max(ys) or 1
    pts = " ".join(f"{x0 + w * x / xmax:.1f},{y0 + h - h * y / ymax:.1f}" for x, y in zip(xs, ys))
    return f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>'


def svg(pts):
    t0 = pts[0][0]
    xs = [p[0] - t0 for p in pts]
    mem = [p[1] / 2**20 for p in pts]
    cpu = [0.0] + [max(0.0, (pts[i][2] - pts[i - 1][2]) / max(1e-6, pts[i][0] - pts[i - 1][0]))
                   for i in range(1, len(pts))]
    W, H = 720, 420
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>']
    for i, (name, ys, color, unit) in enumerate([("memory", mem, "#1f77b4", "MiB"), ("cpu", cpu, "#d62728", "cores")]):
        y0 = 30 + i * 195
        parts.append(f'<rect x="60" y="{y0}" width="620" height="160" fill="none" stroke="#999"/>')
        parts.append(f'<text x="60" y="{y0 - 8}">{name} ({unit}), max {max(ys):.2f}</text>')
        parts.append(polyline(xs, ys, 60, y0, 620, 160, color))
    parts.append(f'<text x="60" y="{H - 8}">seconds since the first sample (0 .. {xs[-1]:.1f}), {len(pts)} samples</text>')
    parts.append("</svg>")
    return "\n".join(parts), max(mem), max(cpu)


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    pts = samples(sys.argv[1])
    if len(pts) < 2:
        print(f"plot: {sys.argv[1]}: fewer than two metrics events in the journal", file=sys.stderr)
        return 1
    text, mem_max, cpu_max = svg(pts)
    pathlib.Path(sys.argv[2]).write_text(text)
    print(f"{sys.argv[2]}: {len(pts)} samples, memory peak {mem_max:.1f} MiB, cpu peak {cpu_max:.2f} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
