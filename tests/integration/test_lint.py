"""The tree's own rules catch what they are for: scripts/check-layers an include or a link that
points up, scripts/function-size a function over 150 lines. Each is run on the real tree (clean)
and on a copy with one violation planted (refused, naming it)."""
import shutil
import subprocess
import sys

import pytest

from sbxtest import ROOT

pytestmark = pytest.mark.timeout(60)


def run(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_the_tree_keeps_the_layer_rule():
    r = run(ROOT / "scripts/check-layers")
    assert r.returncode == 0, r.stdout


@pytest.fixture
def tree(tmp_path):
    """A copy of the C++ folders and their CMakeLists, to plant violations in."""
    dst = tmp_path / "tree"
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.cpp", "*.hpp", "*CMakeLists.txt"],
                         capture_output=True, text=True, check=True).stdout.split()
    for rel in out:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst / rel)
    return dst


def test_an_include_pointing_up_is_refused(tree):
    f = tree / "os/sys.cpp"
    f.write_text('#include "supervisor/box.hpp"\n' + f.read_text())
    r = run(ROOT / "scripts/check-layers", "--root", tree)
    assert r.returncode == 1
    assert "os/sys.cpp:1: os may not include supervisor/box.hpp (layer supervisor)" in r.stdout


def test_a_link_pointing_up_is_refused(tree):
    f = tree / "cli/CMakeLists.txt"
    f.write_text(f.read_text() + "\ntarget_link_libraries(sandboxer PRIVATE sbx_supervisor)\n")
    r = run(ROOT / "scripts/check-layers", "--root", tree)
    assert r.returncode == 1 and "cli may not link sbx_supervisor (layer supervisor)" in r.stdout


def test_a_namespace_not_its_folders_is_refused(tree):
    f = tree / "archive/signing.cpp"
    f.write_text(f.read_text() + "\nnamespace sbx::supervisor {\n}\n")
    r = run(ROOT / "scripts/check-layers", "--root", tree)
    assert r.returncode == 1 and "namespace sbx::supervisor in archive/" in r.stdout


def body(lines):
    return "int f(int x) {\n" + "  x += 1;\n" * (lines - 3) + "  return x;\n}\n"


def test_a_function_of_150_lines_passes_and_151_does_not(tmp_path):
    ok, long = tmp_path / "ok.cpp", tmp_path / "long.cpp"
    ok.write_text("namespace a {\n" + body(150) + "}\n")
    long.write_text("namespace a {\nstruct S {\n  void g() const noexcept {}\n};\n" + body(151) + "}\n")
    assert run(ROOT / "scripts/function-size", ok).returncode == 0
    r = run(ROOT / "scripts/function-size", long)
    assert r.returncode == 1 and f"{long}:5: f is 151 lines" in r.stdout


def test_braces_in_strings_and_comments_do_not_count(tmp_path):
    f = tmp_path / "s.cpp"
    f.write_text('void f() {\n  const char* s = "}}}";\n  // }\n  auto r = R"x(})x";\n}\n' + body(151))
    r = run(ROOT / "scripts/function-size", f)
    assert r.returncode == 1 and f"{f}:6: f is 151 lines" in r.stdout
