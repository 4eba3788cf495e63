"""The functions sandboxer-init runs at start are linked first and together (supervisor/
text-order.ld, written by scripts/text-order; issue 18: spread over the text, they kept ~2.3 MiB
of it resident in every supervisor). The shipped order must still name the functions the link
has and what a box runs at start, and the script must find what a box runs at start, and only
that."""
import re
import subprocess

import pytest

from sbxtest import BUILD, INIT, ROOT, sanitized

ORDER = ROOT / "supervisor" / "text-order.ld"


def ordered_names(path):
    """The symbol of each input section the order names (.text.NAME, .text.startup.NAME, ...)."""
    names = re.findall(r"\*\((\.text\.\S+)\)", path.read_text())
    return [re.sub(r"^\.text\.(unlikely\.|startup\.|hot\.|exit\.)?", "", n) for n in names]


@pytest.mark.skipif(sanitized(), reason="the order is not linked under the sanitizers")
def test_the_linked_order_puts_the_start_up_functions_first():
    sections = subprocess.run(["readelf", "-SW", str(INIT)], capture_output=True, text=True).stdout
    hot = re.search(r"\.text\.sbx_hot\s+PROGBITS\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)", sections)
    assert hot, "sandboxer-init has no .text.sbx_hot: supervisor/CMakeLists.txt no longer links the order"
    start, size = int(hot.group(1), 16), int(hot.group(2), 16)
    addr = {}
    for line in subprocess.run(["nm", "--defined-only", str(INIT)], capture_output=True, text=True).stdout.split("\n"):
        f = line.split()
        if len(f) == 3:
            addr.setdefault(f[2], int(f[0], 16))
    names = ordered_names(ORDER)
    placed = [n for n in names if n in addr and start <= addr[n] < start + size]
    # A function renamed or gone since the order was written falls back to its place in .text:
    # a few cost memory, many mean the order is stale.
    assert len(placed) >= 0.9 * len(names), (
        f"{len(names) - len(placed)} of the {len(names)} functions in {ORDER.name} are not in its section: "
        "run scripts/text-order to write it again")
    assert "main" in placed


@pytest.mark.skipif(sanitized(), reason="scripts/text-order reads the shipped build, not the sanitizers'")
def test_text_order_finds_what_a_box_runs_at_start_and_nothing_else(tmp_path):
    out = tmp_path / "order.ld"
    r = subprocess.run([str(ROOT / "scripts" / "text-order"), str(BUILD), "--out", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    names = ordered_names(out)
    assert len(names) == len(set(names)) > 100
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    # What every box runs at start: main, the box's start, the journal's first write, the server of
    # the run with --listen.
    for f in ("main", "sbx::supervisor::Box::start", "sbx::journal::Journal::append", "sbx::supervisor::Server::"):
        assert f in demangled or f in names, f
    # What a box that neither checkpoints nor moves archives never runs: writing and extracting an
    # archive, its chunks, a signature.
    for f in ("sbx::archive::extract_archive", "sbx::archive::chunk_archive", "sbx::archive::ChunkWriter::",
              "sbx::archive::SigningKey::sign"):
        assert f not in demangled, f
    # The shipped order still names what a box runs now. Functions added to the start since it was
    # written are placed where their source file puts them, each keeping up to 64 KiB of text
    # resident around it: 63 of 723 missing (a month of changes) kept 1.46 MiB of the text resident
    # in every supervisor against 0.97 once written again, and its peak RSS above issue 18's 4 MiB.
    shipped = set(ordered_names(ORDER))
    missing = [n for n in names if n not in shipped]
    assert len(missing) <= 0.05 * len(names), (
        f"{len(missing)} of the {len(names)} functions a box runs at start are not in {ORDER.name} "
        f"(first: {missing[:5]}): run scripts/text-order to write it again")
