"""Shared fixtures: a fresh state dir per test. The shared helpers live in sbxtest.py, which this
file's directory being on sys.path lets every test import.

Integration tests run the real binaries against real processes. Each test is bounded in time
(pytest-timeout, and timeouts on every subprocess call).

At the end of the session the controller (not an xdist worker, which may end while others run)
removes the empty cgroups named sbx-* that appeared during it: a supervisor a test SIGKILLs cannot
remove its branch's groups, and on cgroup v1 each memory group left holds one of the kernel's
65,535 memory cgroup ids. An rmdir removes only an empty group: a box still running keeps its."""
import os

import pytest

CGROUP_ROOT = "/sys/fs/cgroup"


def box_cgroups(depth=6):
    """Every directory named sbx-* within `depth` levels below CGROUP_ROOT."""
    found = set()
    base = CGROUP_ROOT.count("/")
    for root, dirs, _ in os.walk(CGROUP_ROOT):
        if root.count("/") - base >= depth:
            dirs[:] = []
        found.update(os.path.join(root, d) for d in dirs if d.startswith("sbx-"))
    return found


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[BEFORE] = box_cgroups()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or BEFORE not in session.config.stash:
        return
    removed = 0
    # Deepest first: a group below another is removed before its parent.
    for d in sorted(box_cgroups() - session.config.stash[BEFORE], key=lambda p: -p.count("/")):
        try:
            os.rmdir(d)
            removed += 1
        except OSError:
            pass  # still populated (a box that runs on), or gone already
    session.config.stash[REMOVED] = removed


def pytest_terminal_summary(terminalreporter, config):
    if config.stash.get(REMOVED, 0):
        terminalreporter.write_line(f"conftest: removed {config.stash[REMOVED]} empty sbx-* cgroups left by killed supervisors")


BEFORE = pytest.StashKey[set]()
REMOVED = pytest.StashKey[int]()


@pytest.fixture(scope="session", autouse=True)
def health_file(tmp_path_factory):
    """A supervisor that is PID 1 (the tests' `unshare --pid --fork` boxes) writes its health file
    here (SANDBOXER_HEALTH_FILE), not over the host's /run/sandboxer/init.json."""
    path = tmp_path_factory.mktemp("health") / "init.json"
    os.environ["SANDBOXER_HEALTH_FILE"] = str(path)
    return path


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    return d
