"""`sandboxer up` on a dockerd that has a bridge: the box's API is published on 127.0.0.1 only
(`-p 127.0.0.1:PORT:7777`), not on host networking.

These machines' test dockerd has no bridge (scripts/dockerd: --bridge=none). Here a dockerd runs
with its default bridge inside a network namespace the test makes (DOCKERD_NETNS), so docker0 and
the published port exist in that namespace only; the CLI runs there too (nsenter), as it would on
a host whose dockerd has a bridge. No iptables rules anywhere (--iptables=false): docker-proxy
carries the published port."""
import json
import os
import shutil
import subprocess
import time

import pytest

from sbxtest import CLI, start_dockerd, stop_dockerd

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"),
                                reason="needs root, ip and nsenter")

TAG = "sandboxer/agent:e2e-bridge"


@pytest.fixture(scope="module")
def bridged(tmp_path_factory):
    """(env, netns path) of a dockerd with a bridge inside a network namespace of its own."""
    name = f"sbx-e2e-bridge-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    ns = f"/run/netns/{name}"
    base = tmp_path_factory.mktemp("bridged")
    d = base / "d"
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        env = dict(os.environ, DOCKER_HOST=start_dockerd(d, DOCKERD_NETNS=ns), XDG_STATE_HOME=str(base / "state"))
        built = subprocess.run([str(CLI), "image", "build", "--tag", TAG], env=env, capture_output=True, text=True,
                               timeout=600)
        assert built.returncode == 0, built.stderr[-3000:]
        yield env, ns
    finally:
        stop_dockerd(d, locals().get("env"))
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def cli_in(bridged, *args, timeout=120):
    env, ns = bridged
    return subprocess.run(["nsenter", f"--net={ns}", str(CLI), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_up_publishes_the_api_on_loopback_only_where_dockerd_has_a_bridge(bridged):
    env, _ = bridged
    agent = "import time\nprint('hello over the bridge', flush=True)\ntime.sleep(60)\n"
    up = cli_in(bridged, "up", "--host", "docker", "--image", TAG, "--", "python3", "-c", agent)
    assert up.returncode == 0, up.stderr
    url = up.stdout.strip().splitlines()[-1]
    assert url.startswith("ws://127.0.0.1:")
    port = url.rsplit(":", 1)[1]
    try:
        name = next(line.split()[1] for line in up.stderr.splitlines() if line.startswith("box "))
        info = json.loads(subprocess.run(["docker", "inspect", name.rstrip(":")], env=env, capture_output=True,
                                         text=True, check=True).stdout)[0]
        # On the bridge, not the host's network; the API published on 127.0.0.1 alone.
        assert info["HostConfig"]["NetworkMode"] in ("default", "bridge"), info["HostConfig"]["NetworkMode"]
        bindings = [b for v in info["HostConfig"]["PortBindings"].values() for b in v]
        assert bindings == [{"HostIp": "127.0.0.1", "HostPort": port}], bindings
        # The CLI reaches the box through the published port, with the token up stored.
        deadline = time.monotonic() + 30
        seen = ""
        while time.monotonic() < deadline and "hello over the bridge" not in seen:
            r = subprocess.run(["timeout", "5", "nsenter", f"--net={bridged[1]}", str(CLI), "attach", url, "--since",
                                "0", "--json"], env=env, capture_output=True, text=True, timeout=30)
            seen = r.stdout
        assert "hello over the bridge" in seen
        ex = cli_in(bridged, "exec", url, "--", "cat", "/etc/hostname")
        assert ex.returncode == 0, ex.stderr
    finally:
        down = cli_in(bridged, "down", url)
        assert down.returncode == 0, down.stderr
