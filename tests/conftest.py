"""Shared fixtures: a fresh state dir per test. The shared helpers live in sbxtest.py.

Integration tests run the real binaries against real processes. Each test is bounded in time
(pytest-timeout, and timeouts on every subprocess call)."""
import pytest

from sbxtest import BIN, BUILD, CLI, INIT, PROBE, ROOT, read_journal, run_init  # noqa: F401 (older imports)


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    return d
