"""libarchive is loaded when a box first writes or reads an archive, not at start (issue 18: the
supervisor's start-up and memory). A host where it cannot be loaded still runs boxes; a checkpoint
there is refused before the agent is stopped, naming the library and the loader's reason, and
the agent goes on."""
import ctypes.util
import os
import subprocess
import time

from sbxtest import CLI, WsBox, output_of

COUNTER = "import time\nn = 0\nwhile True:\n    n += 1\n    print(n, flush=True)\n    time.sleep(0.05)\n"


def counted(box):
    text = output_of(box.read_events(), "main").decode(errors="replace")
    return [int(x) for x in text[:text.rfind("\n") + 1].split()]


def checkpoint(box):
    return subprocess.run([str(CLI), "checkpoint", box.url, "--token-file", str(box.token_file)],
                          capture_output=True, text=True, timeout=60)


def test_the_supervisor_does_not_load_libarchive_until_an_archive_is_used(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", COUNTER]) as box:
        maps = (f"/proc/{box.proc.pid}/maps")
        time.sleep(0.3)
        assert "libarchive" not in open(maps).read()
        r = checkpoint(box)
        assert r.returncode == 0, r.stderr
        assert "libarchive" in open(maps).read()


def test_a_host_where_libarchive_does_not_load_runs_the_box_and_refuses_checkpoints_naming_why(tmp_path):
    soname = ctypes.util.find_library("archive")
    assert soname and soname.startswith("libarchive.so."), soname
    # The loader finds this one first (LD_LIBRARY_PATH): it is no library.
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / soname).write_text("not a shared object\n")
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib))
    (tmp_path / "box").mkdir()
    with WsBox(tmp_path / "box", ["python3", "-c", COUNTER], env=env) as box:
        time.sleep(0.3)
        r = checkpoint(box)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"load libarchive ({soname})" in r.stderr and "no_libarchive" in r.stderr, r.stderr
        failed = [e for e in box.read_events() if e["type"].startswith("checkpoint.")]
        assert not any(e["type"] == "checkpoint.created" for e in failed), failed
        # Refused before the agent was stopped: it never paused, and goes on.
        n = max(counted(box))
        time.sleep(0.4)
        assert box.alive() and max(counted(box)) > n
    # Control: the same box where the loader finds the real library checkpoints.
    (tmp_path / "control").mkdir()
    with WsBox(tmp_path / "control", ["python3", "-c", COUNTER]) as box:
        time.sleep(0.3)
        r = checkpoint(box)
        assert r.returncode == 0, r.stderr
