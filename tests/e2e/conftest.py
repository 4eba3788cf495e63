"""The Docker tests' shared session fixtures: one private dockerd (scripts/dockerd: own data root
and socket, no bridge, stopped at the end) and one build of the runtime image, for every module
of tests/e2e."""
import os
import subprocess

import pytest

from sbxtest import CLI, start_dockerd, stop_dockerd

TAG = "sandboxer/agent:e2e"


@pytest.fixture(scope="session")
def docker_env(tmp_path_factory):
    """DOCKER_HOST of a private dockerd, and a state home of the session's own for the CLI."""
    base = tmp_path_factory.mktemp("docker")
    d = base / "d"
    env = dict(os.environ, DOCKER_HOST=start_dockerd(d), XDG_STATE_HOME=str(base / "state"))
    yield env
    stop_dockerd(d)


@pytest.fixture(scope="session")
def image(docker_env):
    out = subprocess.run([str(CLI), "image", "build", "--tag", TAG], env=docker_env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == TAG
    return TAG


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`--dist loadgroup`) every Docker test runs on one worker, so the suite
    starts one private dockerd and builds the image once."""
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.xdist_group("docker"))
