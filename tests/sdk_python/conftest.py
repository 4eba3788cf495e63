"""Fixtures of the Python SDK's tests: a real sandboxer-init serving on loopback."""
import pytest

from boxserver import PROBE, BoxServer


@pytest.fixture
def server(tmp_path):
    """A box whose agent waits forever (`sbx-testprobe wait`), serving ws://127.0.0.1:PORT."""
    s = BoxServer(tmp_path, [str(PROBE), "wait"])
    yield s
    s.stop()


@pytest.fixture
def make_server(tmp_path):
    """Starts a box with a given agent argv (and extra sandboxer-init options)."""
    made = []

    def make(argv, extra=None):
        d = tmp_path / f"box{len(made)}"
        d.mkdir()
        s = BoxServer(d, argv, extra)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()

