"""Shared fixtures: a fresh state dir per test. The shared helpers live in sbxtest.py, which this
file's directory being on sys.path lets every test import.

Integration tests run the real binaries against real processes. Each test is bounded in time
(pytest-timeout, and timeouts on every subprocess call)."""
import pytest


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    return d
