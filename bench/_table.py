"""bench/run's aggregation: reads the rows the bench scripts wrote (bench/_rows.py) and prints ONE
table: what was measured, our figure, the peer's figure from the same run, the ratio ours / peer,
which way is better, and the machine and date.

    python3 bench/_table.py ROWS.jsonl [--markdown] [--started TIME] [--load LOADAVG]
"""
import argparse
import json
import os
import platform
import sys
import time


def machine():
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    distro = "unknown distribution"
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    distro = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    return (f"{os.cpu_count()} cores{' (' + cpu + ')' if cpu else ''}, {mem_gib:.0f} GiB, Linux {platform.release()}, "
            f"{distro}")


def num(v):
    if v is None:
        return "-"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if a >= 0.1 or a == 0 else f"{v:.3g}"


def load(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"{path}:{n}: not a JSON row ({e}): {line.strip()[:120]}")
            missing = [k for k in ("bench", "what", "unit", "ours", "better") if k not in r]
            if missing:
                raise SystemExit(f"{path}:{n}: row lacks {', '.join(missing)}: {line.strip()[:120]}")
            rows.append(r)
    return rows


def cells(r):
    ours, peer_value = r.get("ours"), r.get("peer_value")
    ratio = ours / peer_value if ours is not None and peer_value not in (None, 0) else None
    return [r["bench"], r["what"], r["unit"], num(ours), r.get("peer") or "", num(peer_value) if r.get("peer") else "",
            "" if ratio is None else f"{ratio:.2f}",
            f"{r['better']} is better" if ours is not None or peer_value is not None else "", r.get("note", "")]


HEAD = ["bench", "what", "unit", "ours", "peer", "peer's figure", "ratio ours/peer", "better", "note"]


def render(rows, markdown, started, load=None):
    out = [f"machine: {machine()}; run {started}" + (f", load average {load} at its start" if load else "")]
    table = [cells(r) for r in rows]
    if markdown:
        out.append("")
        out.append("| " + " | ".join(HEAD) + " |")
        out.append("|" + "|".join(" --- " for _ in HEAD) + "|")
        for c in table:
            out.append("| " + " | ".join(x.replace("|", "\\|") for x in c) + " |")
        return "\n".join(out)
    width = [max(len(h), *(len(c[i]) for c in table)) if table else len(h) for i, h in enumerate(HEAD)]
    numeric = {3, 5, 6}
    fmt = lambda c: "  ".join(x.rjust(width[i]) if i in numeric else x.ljust(width[i])
                              for i, x in enumerate(c)).rstrip()
    out.append(fmt(HEAD))
    out.append("  ".join("-" * w for w in width))
    out.extend(fmt(c) for c in table)
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--started", default=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    ap.add_argument("--load", help="the 1-minute load average when the run started (other work on the machine)")
    a = ap.parse_args()
    print(render(load(a.rows), a.markdown, a.started, a.load))


if __name__ == "__main__":
    sys.exit(main())
