"""Fixtures of the Python SDK's tests: a real sandboxer-init serving on loopback."""
import pytest

from sbxtest import PROBE, WsBox


def serve(tmp, argv, extra=()):
    """sandboxer-init as PID 1 of a fresh pid namespace serving ws://127.0.0.1:PORT, its metrics
    at the profile's cadence, as a deployed box runs."""
    return WsBox(tmp, argv, extra=extra, as_pid1=True, metrics=None)


@pytest.fixture
def server(tmp_path):
    """A box whose agent waits forever (`sbx-testprobe wait`), serving ws://127.0.0.1:PORT."""
    s = serve(tmp_path, [str(PROBE), "wait"])
    yield s
    s.stop()


@pytest.fixture
def make_server(tmp_path):
    """Starts a box with a given agent argv (and extra sandboxer-init options)."""
    made = []

    def make(argv, extra=None):
        d = tmp_path / f"box{len(made)}"
        d.mkdir()
        s = serve(d, argv, extra or ())
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()

