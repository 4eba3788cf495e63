"""`--host docker` on a dockerd on another machine (issue 17): DOCKER_HOST=tcp://ADDR:2375.

The second "machine" is a dockerd in a network namespace the test makes, with its own data root,
reached from here over a veth pair only (its API on ADDR:2375, boxes' APIs published on ADDR).
It has the image by `docker save | docker load` from the suite's dockerd (the same image id). The
CLI keeps nothing of a box on its own disk but the token: `up` copies the token, profile and keys
into the container before it starts and keeps its state dir in a volume there; `fork` moves the
snapshot over the box API. (Both dockerds share this machine's kernel and filesystem; nothing of
the CLI's working dirs is given to the second one, and the test checks the containers' mounts.)"""
import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.parse

import pytest

from sbxtest import CLI, start_dockerd, stop_dockerd

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"),
                                reason="needs root, ip and nsenter")

# A counter with a nonce kept in memory only (as counter_agent.py, inline: nothing bound in).
COUNTER = ("import json, os, time\n"
           "nonce = os.urandom(8).hex()\n"
           "n = 0\n"
           "while True:\n"
           "    n += 1\n"
           "    print(json.dumps({'n': n, 'nonce': nonce}), flush=True)\n"
           "    time.sleep(0.2)\n")


@pytest.fixture(scope="module")
def remote(docker_env, image, tmp_path_factory):
    """The CLI's environment for the dockerd on the other "machine", and that dockerd's address."""
    name = f"sbx-e2e-remote-{os.getpid()}"
    octet = os.getpid() % 250 + 1
    here, there = f"10.213.{octet}.1", f"10.213.{octet}.2"
    veth = f"sbxr{os.getpid() % 100000}"
    base = tmp_path_factory.mktemp("remote")
    d = base / "d"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        ip = lambda *a: subprocess.run(["ip", *a], check=True, timeout=30)  # noqa: E731
        ip("-n", name, "link", "set", "lo", "up")
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth-remote", "netns", name)
        ip("addr", "add", f"{here}/30", "dev", veth)
        ip("link", "set", veth, "up")
        ip("-n", name, "addr", "add", f"{there}/30", "dev", "eth-remote")
        ip("-n", name, "link", "set", "eth-remote", "up")
        local = start_dockerd(d, DOCKERD_NETNS=f"/run/netns/{name}", DOCKERD_TCP=f"{there}:2375")
        save = subprocess.Popen(["docker", "save", image], env=docker_env, stdout=subprocess.PIPE)
        load = subprocess.run(["docker", "-H", local, "load"], stdin=save.stdout, capture_output=True, text=True,
                              timeout=300)
        save.stdout.close()
        assert save.wait(300) == 0 and load.returncode == 0, load.stderr
        env = dict(os.environ, DOCKER_HOST=f"tcp://{there}:2375", XDG_STATE_HOME=str(base / "cli-state"))
        yield env, there
    finally:
        stop_dockerd(d, locals().get("env"))
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def cli(env, *args, timeout=120):
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=timeout)


def inspect(env, name):
    return json.loads(subprocess.run(["docker", "inspect", name], env=env, capture_output=True, text=True,
                                     check=True).stdout)[0]


def ticks(env, url, until, timeout=30):
    """The counter's lines in the box's journal, read over the API (`log URL`), once `until` holds."""
    deadline = time.monotonic() + timeout
    while True:
        r = cli(env, "log", url, "--json")
        events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
        got = [e["message"] for e in events if e["type"] == "proc.message" and "n" in e.get("message", {})]
        if until(got):
            return got, events
        assert time.monotonic() < deadline, (r.stderr, [e["type"] for e in events][-20:])
        time.sleep(0.3)


def docker_boxes(env):
    """What `ps` lists of the dockerd `env` points at (not the local boxes of the tests beside)."""
    return [b for b in map(json.loads, cli(env, "ps", "--json").stdout.splitlines()) if b["host"] == "docker"]


def box_names(env):
    """The box containers of the dockerd `env` points at."""
    return {b["name"] for b in docker_boxes(env)}


def up(env, *argv):
    r = cli(env, "up", "--host", "docker", "--image", "sandboxer/agent:e2e", "--", *argv)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1], r.stderr


@pytest.mark.timeout(300)
def test_up_on_another_machine_needs_nothing_of_this_ones_filesystem(remote):
    env, there = remote
    url, err = up(env, "python3", "-c", COUNTER)
    boxes = [json.loads(line) for line in cli(env, "ps", "--json").stdout.splitlines()]
    try:
        # The URL is the other machine's address, which this one reaches.
        assert url.startswith(f"ws://{there}:"), (url, err)
        assert f"API published on {there}" in err, err
        (box,) = [b for b in boxes if b["url"] == url]
        info = inspect(env, box["name"])
        # Nothing bound from here: one volume, the box's state dir, on that host.
        assert [(m["Type"], m["Destination"]) for m in info["Mounts"]] == [("volume", "/var/lib/sandboxer/box")]
        assert box["state_dir"].startswith("volume:sbx-state-"), box
        assert not (pathlib.Path(env["XDG_STATE_HOME"]) / "sandboxer" / "docker" / box["name"]).exists()
        # Its journal over the API; the agent runs.
        got, events = ticks(env, url, lambda t: len(t) >= 3)
        assert [t["n"] for t in got[:3]] == [1, 2, 3]
        # The token copied in is the supervisor's, and hidden from the agent as a bound one is.
        token = (pathlib.Path(env["XDG_STATE_HOME"]) / "sandboxer" / "tokens" /
                 urllib.parse.quote(url, safe="")).read_text().strip()
        ex = cli(env, "exec", url, "--", "sh", "-c", "cat /etc/sandboxer/secret/token; ls /etc/sandboxer/secret")
        assert len(token) == 64 and token not in ex.stdout, ex.stdout
        # Control: the file is there, the supervisor's (root's, 0600), outside the agent's view.
        raw = subprocess.run(["docker", "exec", box["name"], "stat", "-c", "%a %u", "/etc/sandboxer/secret/token"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert raw.stdout.split() == ["600", "0"], raw
        raw = subprocess.run(["docker", "exec", box["name"], "cat", "/etc/sandboxer/secret/token"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert raw.stdout.strip() == token
        ok = cli(env, "exec", url, "--", "cat", "/etc/sandboxer/image.json")
        assert ok.returncode == 0 and '"id"' in ok.stdout, ok.stderr
    finally:
        down = cli(env, "down", url)
    assert down.returncode == 0, down.stderr
    assert not [line for line in cli(env, "ps", "--json").stdout.splitlines() if url in line]


@pytest.mark.timeout(300)
def test_fork_on_another_machine_moves_the_snapshot_over_the_api(remote):
    env, there = remote
    url, _ = up(env, "python3", "-c", COUNTER)
    new = []
    try:
        got, _ = ticks(env, url, lambda t: len(t) >= 5)
        cp = cli(env, "checkpoint", url)
        assert cp.returncode == 0, cp.stderr
        snap = cp.stdout.strip().splitlines()[-1]
        before = box_names(env)
        f = cli(env, "fork", url, "--snapshot", snap, "-n", "2", "--host", "docker", timeout=240)
        after = docker_boxes(env)
        new = [b["url"] for b in after if b["name"] not in before]
        assert f.returncode == 0, f.stderr
        urls = [line.split()[1] for line in f.stdout.splitlines()]
        assert sorted(urls) == sorted(new) and len(urls) == 2
        nonce = got[0]["nonce"]
        for u in urls:
            assert u.startswith(f"ws://{there}:")
            copy, events = ticks(env, u, lambda t: len(t) >= 3)
            # A live copy: the original's in-memory nonce, counting on from the checkpoint.
            assert {t["nonce"] for t in copy} == {nonce} and copy[0]["n"] > 1, copy[:3]
            (done,) = [e for e in events if e["type"] == "restore.done"]
            assert done["mode"] == "live" and done["snapshot"] == snap
        n = ticks(env, url, lambda t: True)[0][-1]["n"]
        ticks(env, url, lambda t: t[-1]["n"] >= n + 3)  # the original goes on
    finally:
        for u in [url, *new]:
            cli(env, "down", u)


@pytest.mark.timeout(300)
def test_fork_from_a_box_on_this_machine_onto_another(docker_env, remote):
    # Issue 17's two machines: box A on this machine's dockerd, DOCKER_HOST pointing at the other.
    # The source is not a container there: the fork learns the image (by its sandboxer id) and
    # the profile from the snapshot itself, over A's API.
    _, there = remote
    a_url, _ = up(docker_env, "python3", "-c", COUNTER)
    env_b = dict(docker_env, DOCKER_HOST=f"tcp://{there}:2375")
    urls = []
    try:
        got, events = ticks(docker_env, a_url, lambda t: len(t) >= 5)
        a_box = next(e["box"] for e in events if e["type"] == "box.started")
        cp = cli(docker_env, "checkpoint", a_url)
        assert cp.returncode == 0, cp.stderr
        snap = cp.stdout.strip().splitlines()[-1]
        f = cli(env_b, "fork", a_url, "--snapshot", snap, "-n", "2", "--host", "docker", timeout=240)
        assert f.returncode == 0, f.stderr
        urls = [line.split()[1] for line in f.stdout.splitlines()]
        assert len(urls) == 2 and all(u.startswith(f"ws://{there}:") for u in urls), f.stdout
        for u in urls:
            copy, events = ticks(env_b, u, lambda t: len(t) >= 3)
            assert {t["nonce"] for t in copy} == {got[0]["nonce"]} and copy[0]["n"] > 1, copy[:3]
            (done,) = [e for e in events if e["type"] == "restore.done"]
            assert (done["mode"], done["snapshot"], done["parent_box"]) == ("live", snap, a_box)
        # The copies run the other dockerd's copy of the image: the one labelled with the id.
        names = [json.loads(line)["name"] for line in cli(env_b, "ps", "--json").stdout.splitlines()
                 if json.loads(line)["url"] in urls]
        label = inspect(docker_env, "sandboxer/agent:e2e")["Config"]["Labels"]["io.sandboxer.image.id"]
        for name in names:
            image = inspect(env_b, name)["Image"]
            assert inspect(env_b, image)["Config"]["Labels"]["io.sandboxer.image.id"] == label
        assert len(names) == 2
        n = ticks(docker_env, a_url, lambda t: True)[0][-1]["n"]
        ticks(docker_env, a_url, lambda t: t[-1]["n"] >= n + 3)  # A goes on
        # A snapshot the source does not have: refused, and nothing is left on the other dockerd.
        before = box_names(env_b)
        bad = cli(env_b, "fork", a_url, "--snapshot", "s-0123456789abcdef", "-n", "1", "--host", "docker")
        assert bad.returncode != 0 and "no snapshot s-0123456789abcdef" in bad.stderr, bad.stderr
        assert box_names(env_b) == before
    finally:
        for u in urls:
            cli(env_b, "down", u)
        cli(docker_env, "down", a_url)


def migrate(env, url, *opts, timeout=240):
    return cli(env, "migrate", url, "--to", "docker", *opts, timeout=timeout)


@pytest.mark.timeout(300)
def test_migrate_moves_a_live_agent_onto_the_other_machine_losing_nothing(docker_env, remote):
    _, there = remote
    a_url, _ = up(docker_env, "python3", "-c", COUNTER)
    env_b = dict(docker_env, DOCKER_HOST=f"tcp://{there}:2375")
    (a_box,) = [b for b in map(json.loads, cli(docker_env, "ps", "--json").stdout.splitlines()) if b["url"] == a_url]
    a_name = a_box["name"]
    new_url = None
    try:
        ticks(docker_env, a_url, lambda t: len(t) >= 5)
        m = migrate(env_b, a_url)
        assert m.returncode == 0, m.stderr
        new_url = m.stdout.strip().splitlines()[-1]
        assert new_url.startswith(f"ws://{there}:"), m.stdout
        # The original was held stopped at its checkpoint and ended once the copy ran: its
        # container exited 0 (no restart), its journal saying so.
        deadline = time.monotonic() + 30
        while inspect(docker_env, a_name)["State"]["Status"] != "exited":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert inspect(docker_env, a_name)["State"]["ExitCode"] == 0
        # Its journal stays in its state dir on this machine (the box's API is gone).
        logged = cli(docker_env, "log", a_box["state_dir"], "--json")
        before = [json.loads(line) for line in logged.stdout.splitlines()]
        original = [e["message"] for e in before if e["type"] == "proc.message" and "n" in e.get("message", {})]
        (released,) = [e for e in before if e["type"] == "checkpoint.released"]
        assert released["action"] == "ended"
        # The copy goes on exactly after the original's last line: nothing lost, nothing twice.
        copy, events = ticks(env_b, new_url, lambda t: len(t) >= 3)
        assert {t["nonce"] for t in copy} == {original[0]["nonce"]}
        assert copy[0]["n"] == original[-1]["n"] + 1, (original[-1], copy[:2])
        (done,) = [e for e in events if e["type"] == "restore.done"]
        assert done["mode"] == "live" and done["snapshot"] == released["snapshot"]
    finally:
        if new_url:
            cli(env_b, "down", new_url)
        subprocess.run(["docker", "rm", "-f", a_name], env=docker_env, capture_output=True)


@pytest.mark.timeout(300)
def test_a_migrate_that_fails_leaves_the_agent_going_on_where_it_was(docker_env, remote):
    _, there = remote
    a_url, _ = up(docker_env, "python3", "-c", COUNTER)
    env_b = dict(docker_env, DOCKER_HOST=f"tcp://{there}:2375")
    try:
        ticks(docker_env, a_url, lambda t: len(t) >= 3)
        before = box_names(env_b)
        # Published where this machine cannot reach it (the other machine's own loopback): the
        # copy never answers, so the move fails after the original was held.
        m = migrate(env_b, a_url, "--publish-address", "127.0.0.1")
        assert m.returncode == 1 and "its agent goes on there" in m.stderr, m.stderr
        assert "did not answer" in m.stderr, m.stderr
        assert box_names(env_b) == before
        got, events = ticks(docker_env, a_url, lambda t: True)
        (released,) = [e for e in events if e["type"] == "checkpoint.released"]
        assert released["action"] == "continued"
        n = got[-1]["n"]
        got, _ = ticks(docker_env, a_url, lambda t: t[-1]["n"] >= n + 3)
        # One agent, its memory kept: one nonce, and its count unbroken across the hold.
        assert len({t["nonce"] for t in got}) == 1
        assert [t["n"] for t in got] == list(range(1, len(got) + 1))
    finally:
        cli(docker_env, "down", a_url)
