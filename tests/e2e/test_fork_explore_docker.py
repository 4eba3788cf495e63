"""examples/fork-explore in Docker: `run --host docker` starts a box with `sandboxer up --host
docker --profile explorer` (a profile that asks for checkpoint, so the container gets criu's
capabilities), uploads the agent over the API, gathers each copy's result from the event stream,
shuts the box down and removes its container (`sandboxer down`).

The private dockerd and the image come from test_docker.py's session fixtures (imported here, so
this module starts a dockerd of its own when both modules run)."""
import json
import os
import subprocess
import sys

import pytest

from sbxtest import CLI, ROOT
from test_docker import docker, docker_env, image, token_file  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dockerd and images/build need root")

RUN = ROOT / "examples" / "fork-explore" / "run"
SMALL = ["--copies", "3", "--cities", "150", "--moves", "30000", "--timeout", "90"]


def run_example(env, image, *extra):
    r = subprocess.run([str(RUN), "--host", "docker", "--image", image, "--json", *SMALL, *extra], capture_output=True,
                       text=True, timeout=180, env=dict(env, SANDBOXER_CLI=str(CLI), PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def journal(state_dir):
    out = subprocess.run([str(CLI), "log", state_dir, "--json"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def assert_box_removed(env, s):
    assert s["url"] not in subprocess.run([str(CLI), "ps"], env=env, capture_output=True, text=True,
                                          timeout=60).stdout
    assert not token_file(env, s["url"]).exists()
    assert docker(env, "ps", "-aq").stdout.strip() == ""


@pytest.mark.timeout(300)
def test_fork_explore_in_docker_forks_live_copies(docker_env, image):
    s = run_example(docker_env, image)
    assert s["live_checkpoint"] is True and s["checkpoint"]["mode"] == "live", s
    copies = s["copies"]
    assert len(copies) == 3
    for c in copies:
        assert c["mode"] == "live" and c["continued"] is True, c
        assert c["same_state"] and c["same_nonce"] and c["prefix_s"] == 0, c
    assert s["best"]["length"] == min(c["length"] for c in copies)
    events = journal(s["state_dir"])
    assert next(e for e in events if e["type"] == "box.started")["capabilities"]["isolation"] == "container"
    results = {e["branch"] for e in events if e["type"] == "proc.message" and e["message"].get("step") == "result"}
    assert results == {c["branch"] for c in copies}
    for e in events:
        if e["type"] == "proc.message" and e["message"].get("step") == "continue":
            assert e["message"]["branch_json"]["branch"] == e["branch"] == e["message"]["branch"]
    assert_box_removed(docker_env, s)


@pytest.mark.timeout(300)
def test_fork_explore_in_docker_without_namespaces_falls_back_to_cold_copies(docker_env, image):
    # The same profile with namespaces off: no live checkpoint in the container, so the
    # checkpoint keeps files only and each copy is a cold restart that redoes the prefix.
    s = run_example(docker_env, image, "--set", "isolation.namespaces=false")
    assert s["live_checkpoint"] is False and s["checkpoint"]["mode"] == "fs", s
    for c in s["copies"]:
        assert c["mode"] == "cold" and c["continued"] is False and c["same_state"] is True, c
        assert c["same_nonce"] is False and c["prefix_s"] > 0, c
    assert s["best"]["length"] == min(c["length"] for c in s["copies"])
    assert_box_removed(docker_env, s)
