"""The benchmark row format every bench script writes, so that bench/run can gather them into one
table. A script keeps printing its own table; when SANDBOXER_BENCH_ROWS names a file, it also
appends one JSON line per measured figure:

  {"bench": "checkpoint", "what": "dump, 1 GiB agent", "unit": "ms", "ours": 490.0,
   "peer": "criu CLI", "peer_value": 470.0, "better": "lower"}

"peer"/"peer_value" are null for a figure without a peer. A figure that could not be measured
here is a row with "ours" or "peer_value" null and a "note" saying why (the error, not a guess).

Not a benchmark itself: bench/run skips files whose name starts with "_"."""
import json
import os

QUICK = os.environ.get("BENCH_QUICK") == "1"


def emit(bench, what, unit, ours, peer=None, peer_value=None, better="lower", note=None):
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', not {better!r}")
    path = os.environ.get("SANDBOXER_BENCH_ROWS")
    if not path:
        return
    row = {"bench": bench, "what": what, "unit": unit,
           "ours": None if ours is None else round(float(ours), 4),
           "peer": peer, "peer_value": None if peer_value is None else round(float(peer_value), 4),
           "better": better}
    if note:
        row["note"] = " ".join(str(note).split())[:400]
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
