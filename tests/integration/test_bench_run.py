"""bench/run gathers the rows every benchmark writes (bench/_rows.py) into one table. These run its
quick mode end to end on a real benchmark (pid1: sandboxer-init against tini and dumb-init) and
check the table's shape and arithmetic, never a timing."""
import json
import os
import re
import subprocess

from sbxtest import BIN, ROOT

RUN = ROOT / "bench" / "run"


def bench_run(tmp_path, *args):
    env = dict(os.environ, SANDBOXER_BIN=str(BIN))
    return subprocess.run([str(RUN), "--quick", "--no-setup", "--rows", str(tmp_path / "rows.jsonl"), *args],
                          capture_output=True, text=True, timeout=150, env=env)


def table_rows(stdout):
    """The data lines of the plain table (after the header and its dashes)."""
    lines = stdout.splitlines()
    assert lines[0].startswith("machine: ") and " cores" in lines[0] and "Linux" in lines[0], stdout
    assert lines[1].split()[:4] == ["bench", "what", "unit", "ours"], stdout
    assert set(lines[2].replace(" ", "")) == {"-"}, stdout
    return lines[3:]


def test_quick_pid1_prints_one_table_with_ratios_against_its_peers(tmp_path):
    r = bench_run(tmp_path, "pid1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in (tmp_path / "rows.jsonl").read_text().splitlines()]
    peers = {x["peer"] for x in rows}
    assert {"tini", "dumb-init"} <= peers, rows
    for x in rows:
        assert x["bench"] == "pid1" and x["better"] == "lower" and x["ours"] > 0, x
        assert x["peer_value"] > 0 and "note" not in x, x
    lines = table_rows(r.stdout)
    assert len(lines) == len(rows)
    # Every row's ratio is ours / peer's figure, printed beside both.
    for line, x in zip(lines, rows):
        assert line.startswith("pid1") and x["what"] in line and x["peer"] in line, line
        assert f"{x['ours'] / x['peer_value']:.2f}" in line.split(), line
        assert "lower is better" in line
    # The script's own table still goes out (on stderr, so stdout is the one table).
    assert "run /bin/true under tini" in r.stderr


def test_markdown_table(tmp_path):
    r = bench_run(tmp_path, "--markdown", "pid1")
    assert r.returncode == 0, r.stderr
    md = [l for l in r.stdout.splitlines() if l.startswith("|")]
    assert md[0].startswith("| bench | what | unit | ours | peer |") and md[1].startswith("| --- |")
    assert any(re.search(r"\| tini \| [0-9.]+ \| [0-9.]+ \|", l) for l in md[2:]), r.stdout


def test_a_failing_benchmark_stays_in_the_table_with_why(tmp_path):
    """A benchmark that cannot run says why in a row (the last line of its error), and the
    others' rows are still there; control: pid1 in the same run has its ratios."""
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nsys.exit('broken: needs a device this machine lacks')\n")
    r = bench_run(tmp_path, "pid1", str(broken))
    assert r.returncode == 0, r.stderr
    lines = table_rows(r.stdout)
    why = [l for l in lines if l.startswith("broken")]
    assert len(why) == 1 and "failed (exit 1): broken: needs a device this machine lacks" in why[0], r.stdout
    assert any(l.startswith("pid1") and "tini" in l for l in lines), r.stdout


def test_a_benchmark_that_skips_without_rows_says_why(tmp_path):
    """A script that prints why it cannot run and writes no rows still has its row: its last line."""
    skipping = tmp_path / "skipping.py"
    skipping.write_text("print('measuring...')\nprint('skipping: skipped (needs a GPU)')\n")
    r = bench_run(tmp_path, str(skipping))
    assert r.returncode == 0, r.stderr
    lines = table_rows(r.stdout)
    assert len(lines) == 1 and lines[0].startswith("skipping"), r.stdout
    assert "wrote no rows: skipping: skipped (needs a GPU)" in lines[0], r.stdout


def test_unknown_benchmark_is_refused_by_name(tmp_path):
    r = bench_run(tmp_path, "nosuch")
    assert r.returncode == 2
    assert "no benchmark named nosuch" in r.stderr
