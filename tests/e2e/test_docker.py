"""Docker as a real host: the runtime image with the real sandboxer-init, `sandboxer up --host
docker`, `down`, `ps`, `docker stop`, and the supervisor in a plain `docker run`.

A private dockerd (scripts/dockerd: own data root and socket, no bridge) runs for the session
and is stopped at the end; the image is built once per session by images/docker-image (its root
filesystem comes from images/build's cache after the first build). Both are fixtures of
tests/e2e/conftest.py, shared by every Docker test module."""
import json
import os
import pathlib
import socket
import subprocess
import threading
import time
import urllib.parse

import pytest

from sbxtest import CLI, ROOT, FrameProxy, output_of


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dockerd and images/build need root")

PRIMES = ROOT / "examples" / "primes"


def docker(env, *args, timeout=60, check=True):
    r = subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"docker {' '.join(args)}: {r.stderr}"
    return r


def cli(env, *args, timeout=60):
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=timeout)


def token_file(env, url):
    """The CLI's token store, in the format sdk/python reads (shims/common.py)."""
    return pathlib.Path(env["XDG_STATE_HOME"]) / "sandboxer" / "tokens" / urllib.parse.quote(url, safe="")


class Up:
    """A box started by `sandboxer up --host docker`, removed at the end whatever happened."""

    def __init__(self, env, image, argv, *opts):
        self.env = env
        r = cli(env, "up", "--host", "docker", "--image", image, *opts, "--", *argv)
        assert r.returncode == 0, r.stderr
        self.url = r.stdout.strip().splitlines()[-1]
        assert self.url.startswith("ws://127.0.0.1:")
        self.token = token_file(env, self.url).read_text().strip()
        boxes = [json.loads(line) for line in cli(env, "ps", "--json").stdout.splitlines()]
        (self.box,) = [b for b in boxes if b["url"] == self.url]
        self.name = self.box["name"]
        self.state = pathlib.Path(self.box["state_dir"])

    def inspect(self):
        return json.loads(docker(self.env, "inspect", self.name).stdout)[0]

    def journal(self):
        out = subprocess.run([str(CLI), "log", str(self.state), "--json"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def __enter__(self):
        return self

    def __exit__(self, *a):
        docker(self.env, "rm", "--force", self.name, check=False)


def write_profile(path, **isolation):
    path.write_text(json.dumps({"name": path.stem, "version": 1, "resources": {"grace": "10s"},
                                "isolation": {"namespaces": True, **isolation}}))
    return path


@pytest.mark.timeout(600)
def test_image_has_supervisor_entrypoint_healthcheck_and_image_json(docker_env, image):
    cfg = json.loads(docker(docker_env, "image", "inspect", image).stdout)[0]["Config"]
    assert cfg["Entrypoint"] == ["/usr/local/bin/sandboxer-init"]
    assert cfg["Healthcheck"]["Test"] == ["CMD", "/usr/local/bin/sandboxer-init", "--health"]
    assert cfg["Labels"]["org.opencontainers.image.version"] == "e2e"
    info = json.loads(docker(docker_env, "run", "--rm", "--network", "none", "--entrypoint", "cat", image,
                             "/etc/sandboxer/image.json").stdout)
    assert info["id"] == cfg["Labels"]["io.sandboxer.image.id"] and info["id"].startswith("sha256:")
    assert info["version"] == "e2e" and info["criu"].startswith("4.2")
    out = docker(docker_env, "run", "--rm", "--network", "none", image, "--version").stdout
    assert out.strip() == "sandboxer-init 0.1.0"


@pytest.mark.timeout(120)
def test_up_runs_primes_and_attach_watches_it_finish(docker_env, image):
    # The agent starts once `sandboxer attach` is attached (it would otherwise be done, and its box
    # gone, before a loaded machine lets the client connect): the test drops /workspace/go through
    # the box's state dir on the host.
    argv = ["sh", "-c", "while [ ! -e /workspace/go ]; do sleep 0.05; done; exec python3 /opt/examples/primes/agent.py"]
    with Up(docker_env, image, argv, "-v", f"{PRIMES}:/opt/examples/primes:ro") as box:
        # No token flag: attach finds the token `up` stored for the URL.
        attach = subprocess.Popen([str(CLI), "attach", box.url, "--json"], env=docker_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            first = json.loads(attach.stdout.readline())
            assert first["type"] == "box.started"
            (box.state / "branches" / "main" / "workspace" / "go").touch()
            out, err = attach.communicate(timeout=60)
        finally:
            attach.kill()
        assert attach.returncode == 0, err  # the box closed the stream normally as it ended
        events = [first] + [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        exited = [e for e in events if e["type"] == "proc.exited" and e["proc"] == "main"]
        assert len(exited) == 1 and exited[0]["code"] == 0 and exited[0]["reason"] == "exited"
        assert first["capabilities"]["namespaces"] is True  # the default profile got the caps
        report = [e["message"] for e in events if e["type"] == "proc.message" and e["message"]["step"] == "report"]
        assert report and report[0]["last"] == 229
        # The box ends with its agent, with the agent's status.
        assert docker(docker_env, "wait", box.name, timeout=30).stdout.strip() == "0"


@pytest.mark.timeout(120)
def test_exec_into_a_docker_box_with_the_stored_token(docker_env, image):
    with Up(docker_env, image, ["sleep", "60"]) as box:
        r = cli(docker_env, "exec", box.url, "--", "sh", "-c", "echo in-box; exit 3")
        assert r.returncode == 3 and "in-box" in r.stdout, r.stderr
        # Control: with a wrong token the same request is refused.
        env = dict(docker_env, SANDBOXER_TOKEN="wrong")
        r = cli(env, "exec", box.url, "--", "true")
        assert r.returncode != 0 and r.returncode != 3


class PortTaker:
    """Takes the loopback port of the first container of `image` that appears, before its box
    binds it, and answers every request there 401 as another box would, keeping what it was sent."""

    def __init__(self, env, image):
        self.env, self.image, self.port, self.requests = env, image, None, []
        self.sock = socket.socket()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        deadline = time.monotonic() + 60
        while self.port is None and time.monotonic() < deadline:
            out = docker(self.env, "ps", "--filter", f"ancestor={self.image}", "--format",
                         '{{.Label "io.sandboxer.url"}}', check=False).stdout.split()
            if out:
                self.port = int(out[0].rsplit(":", 1)[1])
                self.sock.bind(("127.0.0.1", self.port))
                self.sock.listen(16)
            time.sleep(0.02)
        while self.port is not None:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(data.decode(errors="replace"))
                conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")

    def close(self):
        self.sock.close()


@pytest.mark.timeout(180)
def test_up_takes_another_port_when_another_server_takes_its_port_before_the_box(docker_env, image):
    # On a host network `up` cannot hold the port it picked across `docker run`: another process
    # may take it first. An image whose supervisor starts 3 s late leaves the time to do that here.
    slow = "sandboxer/agent:e2e-slow-start"
    cid = docker(docker_env, "create", image).stdout.strip()
    try:
        docker(docker_env, "commit", "--change",
               'ENTRYPOINT ["/bin/sh", "-c", "sleep 3; exec /usr/local/bin/sandboxer-init \\"$@\\"", "sh"]', cid, slow)
    finally:
        docker(docker_env, "rm", cid)
    taker = PortTaker(docker_env, slow)
    try:
        with Up(docker_env, slow, ["sleep", "60"]) as box:
            taker.thread.join(timeout=1)
            assert taker.port is not None
            # The box is on a port of its own, and what `up` stored is its token: not 401 there.
            assert box.url != f"ws://127.0.0.1:{taker.port}"
            r = cli(docker_env, "exec", box.url, "--", "sh", "-c", "echo in-box")
            assert r.returncode == 0 and "in-box" in r.stdout, r.stderr
            # The other server was sent a token (the probe's): not the one the box has.
            sent = [line for req in taker.requests for line in req.splitlines() if line.lower().startswith("authorization")]
            assert sent and all(box.token not in line for line in sent)
            assert box.inspect()["Config"]["Labels"]["io.sandboxer.url"] == box.url
    finally:
        taker.close()
        docker(docker_env, "rmi", slow, check=False)


@pytest.mark.timeout(120)
def test_up_token_is_a_read_only_file_and_never_on_a_command_line(docker_env, image):
    agent = ["sh", "-c", "cat /etc/sandboxer/secret/token; echo cat=$?; exec sleep 60"]
    with Up(docker_env, image, agent) as box:
        info = box.inspect()
        assert box.token and box.token not in json.dumps(info)  # not in Cmd, Env, labels, mounts
        (mount,) = [m for m in info["Mounts"] if m["Destination"] == "/etc/sandboxer/secret/token"]
        assert mount["RW"] is False
        assert oct(token_file(docker_env, box.url).stat().st_mode & 0o777) == "0o600"
        ps = docker(docker_env, "exec", box.name, "ps", "-eo", "args").stdout
        assert box.token not in ps
        assert info["HostConfig"]["NetworkMode"] == "host"  # this dockerd has no bridge
        assert info["Config"]["StopTimeout"] == 15  # grace 10 s + 5
        # The agent (own mount namespace) sees the token file masked: empty, or not readable.
        deadline = time.monotonic() + 20
        while b"cat=" not in output_of(box.journal(), "main"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        out = output_of(box.journal(), "main")
        assert box.token.encode() not in out and out.startswith(b"cat=")


@pytest.mark.timeout(120)
def test_box_without_namespaces_keeps_the_token_from_an_agent_under_another_uid(docker_env, image, tmp_path):
    # Without namespaces the supervisor cannot mask the token file: the file's mode (0600, root)
    # is what keeps it from the agent, so the agent must not run as root (the control shows why).
    agent = ["sh", "-c", "cat /etc/sandboxer/secret/token >/dev/null 2>&1; echo cat=$?; exec sleep 60"]
    results = {}
    for user in ({"uid": 65534, "gid": 65534}, "root"):
        prof = tmp_path / f"flat-{'root' if user == 'root' else 'nobody'}.json"
        prof.write_text(json.dumps({"name": prof.stem, "version": 1, "resources": {"grace": "1s"},
                                    "isolation": {"namespaces": False, "user": user}}))
        with Up(docker_env, image, agent, "--profile", str(prof)) as box:
            deadline = time.monotonic() + 20
            while b"cat=" not in output_of(box.journal(), "main"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            results[prof.stem] = output_of(box.journal(), "main").decode()
    assert "cat=1" in results["flat-nobody"]
    assert "cat=0" in results["flat-root"]  # control: root in the same mount namespace reads it


@pytest.mark.timeout(120)
def test_up_adds_checkpoint_caps_only_when_the_profile_needs_them(docker_env, image, tmp_path):
    plain = write_profile(tmp_path / "flat.json", namespaces=False)
    with Up(docker_env, image, ["sleep", "60"], "--profile", str(plain)) as box:
        hc = box.inspect()["HostConfig"]
        assert not hc["CapAdd"] and not hc["SecurityOpt"]
    with Up(docker_env, image, ["sleep", "60"]) as box:  # default: namespaces, live checkpoint
        hc = box.inspect()["HostConfig"]
        assert sorted(hc["CapAdd"]) == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_TIME"] or \
            sorted(hc["CapAdd"]) == ["NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE", "SYS_TIME"]
        assert hc["SecurityOpt"] == ["seccomp=unconfined"]
        assert "/run" in hc["Tmpfs"]


@pytest.mark.timeout(120)
def test_up_maps_the_profile_limits_to_docker(docker_env, image, tmp_path):
    prof = tmp_path / "small.json"
    prof.write_text(json.dumps({"name": "small", "version": 1,
                                "resources": {"memory": "300M", "cpus": 0.5, "pids": 64, "grace": "1s"},
                                "isolation": {"namespaces": False}}))
    with Up(docker_env, image, ["sleep", "60"], "--profile", str(prof)) as box:
        hc = box.inspect()["HostConfig"]
        assert hc["Memory"] == 300 << 20 and hc["MemorySwap"] == 300 << 20
        assert hc["NanoCpus"] == 500_000_000
        assert hc["PidsLimit"] == 64 + 32
        assert box.inspect()["Config"]["StopTimeout"] == 6
        # The container's memory cgroup holds the ceiling the agent lives under.
        r = docker(docker_env, "exec", box.name, "sh", "-c",
                   "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max")
        assert int(r.stdout) == 300 << 20  # cgroup v1 here, v2 elsewhere


@pytest.mark.timeout(120)
def test_docker_stop_gives_the_agent_term_and_the_grace_period(docker_env, image):
    # The agent says it got TERM and then ignores it: the supervisor must wait the grace period
    # (2 s), send KILL, and write it all to the journal before Docker's stop timeout (7 s).
    agent = ("import signal, sys, time\n"
             "def term(*_):\n    print('got TERM', flush=True)\n"
             "signal.signal(signal.SIGTERM, term)\n"
             "print('ready', flush=True)\n"
             "while True: time.sleep(0.1)\n")
    with Up(docker_env, image, ["python3", "-c", agent], "--set", "resources.grace=2s") as box:
        assert box.inspect()["Config"]["StopTimeout"] == 7
        deadline = time.monotonic() + 20
        while not any(e["type"] == "proc.output" and "ready" in e.get("data", "") for e in box.journal()):
            assert time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.1)
        t0 = time.monotonic()
        docker(docker_env, "stop", box.name, timeout=30)
        took = time.monotonic() - t0
        assert 2.0 <= took < 7.0, took
        events = box.journal()
        assert b"got TERM" in output_of(events, "main")
        exited = [e for e in events if e["type"] == "proc.exited" and e["proc"] == "main"]
        assert len(exited) == 1
        assert exited[0]["reason"] == "shutdown" and exited[0]["escalated"] is True
        assert exited[0]["signal"] in ("KILL", 9)
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # no gap


@pytest.mark.timeout(120)
def test_supervisor_in_a_plain_docker_run_says_what_it_cannot_do(docker_env, image):
    r = docker(docker_env, "run", "--rm", "--network", "none", image, "--events", "-", "--metrics-interval", "0",
               "--", "python3", "-c", "print('hello from a plain container')", check=False)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    caps = next(e for e in events if e["type"] == "box.started")["capabilities"]
    assert caps["namespaces"] is False
    assert "Operation not permitted" in caps["namespaces_why_not"]
    assert caps["live_checkpoint"] is False and "namespace" in caps["why_not"]
    assert caps["isolation"] == "container"
    assert b"hello from a plain container" in output_of(events, "main")
    exited = next(e for e in events if e["type"] == "proc.exited")
    assert exited["code"] == 0


@pytest.mark.timeout(120)
def test_health_answers_in_a_box_and_fails_without_a_supervisor(docker_env, image):
    with Up(docker_env, image, ["sleep", "60"]) as box:
        r = docker(docker_env, "exec", box.name, "sandboxer-init", "--health", check=False)
        assert r.returncode == 0 and r.stdout.startswith("healthy: the WebSocket API"), r.stdout
        # Docker's own HEALTHCHECK (every 5 s) runs the same command.
        deadline = time.monotonic() + 20
        while box.inspect()["State"]["Health"]["Status"] != "healthy":
            assert time.monotonic() < deadline, box.inspect()["State"]["Health"]
            time.sleep(0.5)
    # A supervisor without the API (a plain `docker run`) is healthy while it runs.
    name = "sbx-health-plain"
    docker(docker_env, "run", "-d", "--name", name, "--network", "none", image, "--", "sleep", "30")
    try:
        deadline = time.monotonic() + 20
        while True:
            r = docker(docker_env, "exec", name, "sandboxer-init", "--health", check=False)
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # until the supervisor has written /run/sandboxer/init.json
        assert r.returncode == 0 and "serves no WebSocket API" in r.stdout, r.stdout
    finally:
        docker(docker_env, "rm", "--force", name, check=False)
    # Control: the same image with no supervisor running.
    r = docker(docker_env, "run", "--rm", "--network", "none", "--entrypoint", "/usr/local/bin/sandboxer-init",
               image, "--health", check=False)
    assert r.returncode == 1 and r.stdout.startswith("unhealthy:"), r.stdout


@pytest.mark.timeout(120)
def test_ps_lists_a_box_and_down_removes_it_and_its_token(docker_env, image):
    box = Up(docker_env, image, ["sleep", "60"])
    with box:
        assert box.box["status"].startswith("Up")
        r = cli(docker_env, "down", box.url)
        assert r.returncode == 0, r.stderr
        assert box.name in r.stdout
        assert not token_file(docker_env, box.url).exists()
        assert box.url not in cli(docker_env, "ps").stdout
        assert docker(docker_env, "inspect", box.name, check=False).returncode != 0
        # The journal outlives the container: `sleep` got TERM from the supervisor.
        exited = [e for e in box.journal() if e["type"] == "proc.exited"]
        assert exited and exited[-1]["reason"] == "shutdown"


@pytest.mark.timeout(60)
def test_up_refuses_bad_input_with_a_clear_error(docker_env, image, tmp_path):
    before = docker(docker_env, "ps", "-aq").stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "version": 1, "resources": {"grace": "soon"}}))
    r = cli(docker_env, "up", "--host", "docker", "--profile", str(bad), "--", "true")
    assert r.returncode != 0 and "resources.grace" in r.stderr
    r = cli(docker_env, "up", "--host", "kubernetes", "--", "true")
    assert r.returncode != 0 and "--host kubernetes" in r.stderr
    r = cli(docker_env, "up", "--host", "docker", "--image", "sandboxer/missing:1", "--", "true")
    assert r.returncode != 0 and "sandboxer/missing" in r.stderr
    # A word docker's API would carry with U+FFFD for its bytes: refused before anything is made.
    r = cli(docker_env, "up", "--host", "docker", "--image", image, "--", "echo", b"a\xffb")
    assert r.returncode == 2 and 'CMD word 1 "a\\xffb" is not UTF-8' in r.stderr, r.stderr
    r = cli(docker_env, "up", "--host", "docker", "--image", image, "--env", b"K=\xfe", "--", "true")
    assert r.returncode == 2 and '--env "K=\\xfe" is not UTF-8' in r.stderr, r.stderr
    r = cli(docker_env, "down", "ws://127.0.0.1:1")
    assert r.returncode != 0 and "no box container" in r.stderr
    # This dockerd is this machine's: its boxes publish on loopback only, whatever is asked.
    r = cli(docker_env, "up", "--host", "docker", "--image", image, "--publish-address", "10.0.0.1", "--", "true")
    assert r.returncode != 0 and "--publish-address 10.0.0.1" in r.stderr and "127.0.0.1 only" in r.stderr, r.stderr
    # Control: a good profile starts.
    with Up(docker_env, image, ["sleep", "5"]):
        pass
    assert docker(docker_env, "ps", "-aq").stdout == before


@pytest.mark.timeout(120)
def test_up_with_a_signing_key_of_its_own_gives_the_box_that_key_and_not_the_users(docker_env, image, tmp_path):
    key = tmp_path / "box.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True)
    r = cli(docker_env, "up", "--host", "docker", "--trust-key", str(key), "--", "true")
    assert r.returncode == 2 and "only with --signing-key" in r.stderr, r.stderr
    r = cli(docker_env, "up", "--host", "docker", "--signing-key", str(tmp_path / "none.pem"), "--", "true")
    assert r.returncode == 2 and "none.pem" in r.stderr, r.stderr

    def key_in(box):
        return docker(docker_env, "exec", box.name, "cat", "/etc/sandboxer/secret/signing-key").stdout

    with Up(docker_env, image, ["sleep", "60"], "--signing-key", str(key)) as box:
        assert key_in(box) == key.read_text()
    # Control: without it the box gets the user's own key.
    with Up(docker_env, image, ["sleep", "60"]) as box:
        mine = key_in(box)
        assert "PRIVATE KEY" in mine and mine != key.read_text()


@pytest.mark.timeout(180)
def test_without_the_checkpoint_caps_checkpoint_is_files_only_and_fork_a_cold_restart(docker_env, image, tmp_path):
    # A plain container (no added capabilities): no criu dump is possible, so a checkpoint is of
    # the files only and says so, and a fork restarts the agent's command on a copy of them, told
    # that it was resumed.
    plain = write_profile(tmp_path / "plain.json", namespaces=False)
    agent = ["sh", "-c", "echo resumed=${SANDBOXER_RESUMED:-0} snapshot=${SANDBOXER_SNAPSHOT:-none}; exec sleep 60"]
    with Up(docker_env, image, agent, "--profile", str(plain)) as box:
        assert not box.inspect()["HostConfig"]["CapAdd"]
        deadline = time.monotonic() + 20
        while b"resumed=0" not in output_of(box.journal(), "main"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = cli(docker_env, "checkpoint", box.url, timeout=120)
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip().splitlines()[-1]
        assert snap.startswith("s-")
        created = [e for e in box.journal() if e["type"] == "checkpoint.created"]
        assert created and created[-1]["mode"] != "live", created
        f = cli(docker_env, "fork", box.url, "--snapshot", snap, "-n", "1", timeout=120)
        assert f.returncode == 0, f.stderr
        branch, proc = f.stdout.split()[:2]
        deadline = time.monotonic() + 30
        while f"snapshot={snap}".encode() not in output_of(box.journal(), proc):
            assert time.monotonic() < deadline, json.dumps([e for e in box.journal() if e.get("branch") == branch])
            time.sleep(0.2)
        assert b"resumed=1" in output_of(box.journal(), proc)
        done = [e for e in box.journal() if e["type"] == "restore.done" and e["branch"] == branch]
        assert done and done[0]["mode"] == "cold"
        # Into a new container: the same cold restart there, as that box's main agent.
        before = {b["name"] for b in boxes_by_url(docker_env).values()}
        f = cli(docker_env, "fork", box.url, "--snapshot", snap, "--host", "docker", timeout=120)
        new = [b for b in boxes_by_url(docker_env).values() if b["name"] not in before]
        try:
            assert f.returncode == 0, f.stderr
            (url,) = [line.split()[1] for line in f.stdout.splitlines()]
            (b,) = [b for b in new if b["url"] == url]
            deadline = time.monotonic() + 30
            while f"snapshot={snap}".encode() not in output_of(events_of(b["state_dir"]), "main"):
                assert time.monotonic() < deadline, json.dumps(events_of(b["state_dir"]))[-3000:]
                time.sleep(0.2)
            (done,) = [e for e in events_of(b["state_dir"]) if e["type"] == "restore.done"]
            assert done["mode"] == "cold"
            assert not json.loads(docker(docker_env, "inspect", b["name"]).stdout)[0]["HostConfig"]["CapAdd"]
        finally:
            for b in new:
                docker(docker_env, "rm", "--force", b["name"], check=False)


# ---- live checkpoint, restore and fork inside a container (issues 5 and 6) ----

E2E = ROOT / "tests" / "e2e"
COUNTER = ["python3", "/opt/e2e/counter_agent.py"]


def ticks(events, branch):
    """The counter agent's JSON lines (n, nonce, branch) of one branch, in order."""
    return [e["message"] for e in events if e["type"] == "proc.message" and e["branch"] == branch
            and "n" in e["message"]]


def wait_for(box, what, cond, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        events = box.journal()
        if cond(events):
            return events
        assert time.monotonic() < deadline, f"{what}: " + json.dumps([e for e in events if e["type"] != "proc.output"
                                                                      and e["type"] != "proc.message"])[-3000:]
        time.sleep(0.2)


def wait_for_memory(state_dir, done, timeout=30):
    """The restore.memory_complete of the copy `done` (a restore.done) in the box at `state_dir`."""
    deadline = time.monotonic() + timeout
    while not (mc := [e for e in events_of(state_dir) if e["type"] == "restore.memory_complete"
                      and e["branch"] == done["branch"]]):
        assert time.monotonic() < deadline, json.dumps(events_of(state_dir))[-3000:]
        time.sleep(0.2)
    assert mc[0]["ok"] is True and mc[0]["seq"] > done["seq"], mc


def counter_box(env, image, *opts):
    box = Up(env, image, COUNTER, "-v", f"{E2E}:/opt/e2e:ro", *opts)
    wait_for(box, "the agent counts", lambda ev: len(ticks(ev, "main")) >= 5)
    return box


def live_checkpoint(env, box, *opts):
    r = cli(env, "checkpoint", box.url, *opts, timeout=120)
    assert r.returncode == 0, r.stderr
    snap = r.stdout.strip().splitlines()[-1]
    created = [e for e in box.journal() if e["type"] == "checkpoint.created" and e["snapshot"] == snap]
    assert created and created[0]["mode"] == "live", created
    return snap


def assert_continues(original, copy):
    """A live copy: the original's in-memory nonce, and its counter going on from where the
    checkpoint froze it (a value the original also printed), not from 1."""
    assert copy, "the copy printed nothing"
    nonce = original[0]["nonce"]
    assert {t["nonce"] for t in copy} == {nonce}
    first = copy[0]["n"]
    assert first >= 2 and first - 1 in [t["n"] for t in original], (first, original[-1])
    assert [t["n"] for t in copy] == list(range(first, first + len(copy)))


@pytest.mark.timeout(180)
def test_live_restore_in_a_container_continues_the_agent(docker_env, image):
    with counter_box(docker_env, image) as box:  # the default profile: persistence "checkpoint"
        snap = live_checkpoint(docker_env, box)
        r = cli(docker_env, "restore", box.url, snap, timeout=120)
        assert r.returncode == 0, r.stderr
        branch = r.stdout.split()[0]
        events = wait_for(box, "the copy counts", lambda ev: len(ticks(ev, branch)) >= 3)
        (done,) = [e for e in events if e["type"] == "restore.done" and e["branch"] == branch]
        assert done["mode"] == "live" and done["snapshot"] == snap
        copy = ticks(events, branch)
        assert_continues(ticks(events, "main"), copy)
        assert {t["branch"] for t in copy} == {branch}  # its own /run/sandboxer/branch.json
        # Both branches run under the image's small ns-init program (not the supervisor's own mode).
        ps = docker(docker_env, "exec", box.name, "sh", "-c",
                    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done").stdout
        assert [line.strip() for line in ps.splitlines() if "ns-init" in line] == ["/run/sandboxer/bin/ns-init"] * 2
        # leave_running: the original goes on beside its copy.
        before = ticks(events, "main")[-1]["n"]
        wait_for(box, "the original goes on", lambda ev: ticks(ev, "main")[-1]["n"] >= before + 3)


@pytest.mark.timeout(180)
def test_live_fork_of_two_in_a_container_runs_both_copies(docker_env, image):
    with counter_box(docker_env, image) as box:
        snap = live_checkpoint(docker_env, box)
        r = cli(docker_env, "fork", box.url, "--snapshot", snap, "-n", "2", timeout=120)
        assert r.returncode == 0, r.stderr
        branches = sorted(line.split()[0] for line in r.stdout.splitlines())
        assert len(branches) == 2
        events = wait_for(box, "both copies count", lambda ev: all(len(ticks(ev, b)) >= 3 for b in branches))
        for b in branches:
            (done,) = [e for e in events if e["type"] == "restore.done" and e["branch"] == b]
            assert done["mode"] == "live"
            # Lazy pages inside a container (userfaultfd under the checkpoint caps), as on a host.
            assert done["lazy"] is True, done
            complete = wait_for(box, "the copy's memory completes",
                                lambda ev: [e for e in ev if e["type"] == "restore.memory_complete" and e["branch"] == b])
            (mc,) = [e for e in complete if e["type"] == "restore.memory_complete" and e["branch"] == b]
            assert mc["ok"] is True and mc["seq"] > done["seq"]
            assert_continues(ticks(events, "main"), ticks(events, b))
        # Each copy has a pid and network namespace of its own: the same listener port in each.
        assert box.inspect()["State"]["Running"]
        before = ticks(events, "main")[-1]["n"]
        wait_for(box, "the original goes on", lambda ev: ticks(ev, "main")[-1]["n"] >= before + 3)


@pytest.mark.timeout(180)
def test_a_copy_with_its_own_hostname_is_checkpointed_and_restored_in_a_container(docker_env, image):
    # A copy runs in a UTS namespace of its own; restoring a dump of it sets that hostname through
    # /proc/sys, which Docker binds read-only: criu restores in a mount namespace without that bind.
    with counter_box(docker_env, image) as box:
        snap = live_checkpoint(docker_env, box)
        r = cli(docker_env, "restore", box.url, snap, timeout=120)
        assert r.returncode == 0, r.stderr
        first = r.stdout.split()[0]
        wait_for(box, "the copy counts", lambda ev: len(ticks(ev, first)) >= 2)
        again = live_checkpoint(docker_env, box, "--branch", first)
        r = cli(docker_env, "restore", box.url, again, timeout=120)
        assert r.returncode == 0, r.stderr
        second = r.stdout.split()[0]
        events = wait_for(box, "the copy of the copy counts", lambda ev: len(ticks(ev, second)) >= 3)
        (done,) = [e for e in events if e["type"] == "restore.done" and e["branch"] == second]
        assert done["mode"] == "live"
        assert_continues(ticks(events, first), ticks(events, second))



# ---- an archive from another image ----

@pytest.mark.timeout(240)
def test_an_archive_from_another_image_is_refused_with_the_reason(docker_env, image, tmp_path):
    # Another image: the same one with another id in /etc/sandboxer/image.json (docker commit of a
    # created container, so entrypoint and labels stay).
    other = "sandboxer/agent:e2e-other"
    info = json.loads(docker(docker_env, "run", "--rm", "--network", "none", "--entrypoint", "cat", image,
                             "/etc/sandboxer/image.json").stdout)
    changed = tmp_path / "image.json"
    changed.write_text(json.dumps(dict(info, id="sha256:" + "0" * 64)))
    cid = docker(docker_env, "create", image, "--version").stdout.strip()
    try:
        docker(docker_env, "cp", str(changed), f"{cid}:/etc/sandboxer/image.json")
        docker(docker_env, "commit", cid, other)
    finally:
        docker(docker_env, "rm", "--force", cid, check=False)
    with counter_box(docker_env, image) as a:
        snap = live_checkpoint(docker_env, a)
        manifest = [s for s in (json.loads(x) for x in cli(docker_env, "snapshots", a.url, "--json").stdout.splitlines())
                    if s["id"] == snap][0]
        assert manifest["image"] == info["id"]  # the manifest names the image it was made in
        archive = tmp_path / "a.tar.zst"
        r = cli(docker_env, "export", a.url, snap, str(archive), timeout=120)
        assert r.returncode == 0, r.stderr
        results = {}
        for tag in (other, image):  # the other image, then the control: the same image
            # The agent's bind mounts must be where they were: B gets A's volume too.
            with Up(docker_env, tag, ["sleep", "120"], "-v", f"{E2E}:/opt/e2e:ro") as b:
                r = cli(docker_env, "import", b.url, str(archive), timeout=120)
                assert r.returncode == 0, r.stderr
                results[tag] = cli(docker_env, "restore", b.url, snap, timeout=120)
        refused = results[other]
        assert refused.returncode != 0
        assert f"image {info['id']}" in refused.stderr and "sha256:" + "0" * 64 in refused.stderr, refused.stderr
        assert results[image].returncode == 0, results[image].stderr


# ---- fork into new containers (issue 6) ----

def boxes_by_url(env):
    """docker's boxes by URL (`ps` lists the local boxes of the tests beside this one too)."""
    return {b["url"]: b for b in (json.loads(line) for line in cli(env, "ps", "--json").stdout.splitlines())
            if b["host"] == "docker"}


def events_of(state_dir):
    out = subprocess.run([str(CLI), "log", str(state_dir), "--json"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(240)
def test_fork_into_two_new_containers_continues_the_agent_in_each(docker_env, image):
    with counter_box(docker_env, image) as a:
        snap = live_checkpoint(docker_env, a)
        before = {b["name"] for b in boxes_by_url(docker_env).values()}
        r = cli(docker_env, "fork", a.url, "--snapshot", snap, "-n", "2", "--host", "docker", timeout=180)
        new = [b["name"] for b in boxes_by_url(docker_env).values() if b["name"] not in before]
        try:
            assert r.returncode == 0, r.stderr
            lines = [line.split() for line in r.stdout.strip().splitlines()]
            assert len(lines) == 2 and all(branch == "main" for branch, _ in lines), r.stdout
            urls = [url for _, url in lines]
            assert len(set(urls)) == 2 and a.url not in urls
            boxes = boxes_by_url(docker_env)
            started = next(e for e in a.journal() if e["type"] == "box.started")
            indexes = []
            for url in urls:
                b = boxes[url]
                assert b["name"] in new and b["status"].startswith("Up")
                deadline = time.monotonic() + 30
                while len(ticks(events_of(b["state_dir"]), "main")) < 3:
                    assert time.monotonic() < deadline, json.dumps(events_of(b["state_dir"]))[-3000:]
                    time.sleep(0.2)
                events = events_of(b["state_dir"])
                (done,) = [e for e in events if e["type"] == "restore.done"]
                assert done["mode"] == "live" and done["snapshot"] == snap
                assert done["parent_box"] == started["box"]
                # Lazy in a new container too: it runs before its memory is all there, which then
                # arrives from its lazy-pages daemon.
                assert done["lazy"] is True, done
                wait_for_memory(b["state_dir"], done)
                assert_continues(ticks(a.journal(), "main"), ticks(events, "main"))
                # Each copy knows which it is (its branch.json), as copies in one box do.
                assert {t["index"] for t in ticks(events, "main")} == {done["index"]}
                indexes.append(done["index"])
                # The same image (by id) and profile as A, and its caps.
                info = json.loads(docker(docker_env, "inspect", b["name"]).stdout)[0]
                assert info["Image"] == a.inspect()["Image"]
                assert "CAP_SYS_ADMIN" in info["HostConfig"]["CapAdd"] or "SYS_ADMIN" in info["HostConfig"]["CapAdd"]
                # The token is stored for the URL: attach needs no flag.
                att = subprocess.Popen([str(CLI), "attach", url, "--since", "0", "--json"], env=docker_env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    # The box started idle, took the snapshot in, then became the copy.
                    types = [json.loads(att.stdout.readline())["type"] for _ in range(4)]
                    assert types == ["box.started", "server.listening", "snapshot.imported", "restore.done"], types
                finally:
                    att.kill()
                    att.wait()
            assert sorted(indexes) == [0, 1]
            # A keeps running, counting on.
            n = ticks(a.journal(), "main")[-1]["n"]
            wait_for(a, "A goes on", lambda ev: ticks(ev, "main")[-1]["n"] >= n + 3)
        finally:
            for name in new:
                docker(docker_env, "rm", "--force", name, check=False)


@pytest.mark.timeout(120)
def test_fork_into_containers_fails_clearly_and_leaves_no_container(docker_env, image):
    with counter_box(docker_env, image) as a:
        before = docker(docker_env, "ps", "-aq").stdout
        r = cli(docker_env, "fork", a.url, "--snapshot", "s-0123456789abcdef", "-n", "2", "--host", "docker")
        assert r.returncode != 0 and "s-0123456789abcdef" in r.stderr and "no snapshot" in r.stderr, r.stderr
        assert docker(docker_env, "ps", "-aq").stdout == before
        r = cli(docker_env, "fork", "ws://127.0.0.1:1", "--snapshot", "s-0123456789abcdef", "--host", "docker")
        assert r.returncode != 0 and "no box container for ws://127.0.0.1:1" in r.stderr, r.stderr
        r = cli(docker_env, "fork", a.url, "--snapshot", "s-0123456789abcdef", "--host", "kubernetes")
        assert r.returncode != 0 and "--host kubernetes" in r.stderr, r.stderr


@pytest.mark.timeout(240)
def test_fork_into_containers_over_a_cut_stream_removes_them_and_leaves_the_source(docker_env, image, tmp_path):
    """The export cut halfway by a proxy in front of A (the relay reads from the proxy's URL): the
    new containers never import a partial archive, every one is removed, and A counts on. The
    same fork straight from A is the control."""
    with counter_box(docker_env, image) as a:
        snap = live_checkpoint(docker_env, a)
        whole = tmp_path / "whole.tar.zst"
        assert cli(docker_env, "export", a.url, snap, str(whole), timeout=120).returncode == 0
        port = int(a.url.rsplit(":", 1)[1])
        proxy = FrameProxy(port, cut=whole.stat().st_size // 2)
        env = dict(docker_env, SANDBOXER_TOKEN=token_file(docker_env, a.url).read_text().strip())
        before = docker(docker_env, "ps", "-aq").stdout
        try:
            r = cli(env, "fork", proxy.url, "--snapshot", snap, "-n", "2", "--host", "docker", timeout=180)
        finally:
            proxy.close()
        assert proxy.acted
        assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
        assert "the containers it started are removed" in r.stderr and "closed after" in r.stderr, r.stderr
        assert docker(docker_env, "ps", "-aq").stdout == before
        n = ticks(a.journal(), "main")[-1]["n"]
        wait_for(a, "A goes on", lambda ev: ticks(ev, "main")[-1]["n"] >= n + 3)
        ok = cli(docker_env, "fork", a.url, "--snapshot", snap, "-n", "1", "--host", "docker", timeout=180)
        try:
            assert ok.returncode == 0, ok.stderr
        finally:
            for line in ok.stdout.splitlines():
                name = boxes_by_url(docker_env).get(line.split()[1], {}).get("name")
                if name:
                    docker(docker_env, "rm", "--force", name, check=False)


@pytest.mark.timeout(300)
def test_a_fork_of_a_box_with_its_own_key_restores_live_where_the_copies_trust_it(docker_env, image, tmp_path):
    key, pub = tmp_path / "box.pem", tmp_path / "box.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True)
    with counter_box(docker_env, image, "--signing-key", str(key)) as a:
        snap = live_checkpoint(docker_env, a)
        before = {b["name"] for b in boxes_by_url(docker_env).values()}
        try:
            # The copies trust the user's key only: the snapshot A signed with its own is not theirs.
            r = cli(docker_env, "fork", a.url, "--snapshot", snap, "-n", "1", "--host", "docker", timeout=180)
            assert r.returncode == 1 and "box.pem" not in r.stderr, r.stderr
            assert "trusted" in r.stderr or "signed" in r.stderr, r.stderr
            r = cli(docker_env, "fork", a.url, "--snapshot", snap, "-n", "1", "--host", "docker", "--trust-key",
                    str(pub), timeout=180)
            assert r.returncode == 0, r.stderr
            (url,) = [line.split()[1] for line in r.stdout.splitlines()]
            b = boxes_by_url(docker_env)[url]
            deadline = time.monotonic() + 30
            while len(ticks(events_of(b["state_dir"]), "main")) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            (done,) = [e for e in events_of(b["state_dir"]) if e["type"] == "restore.done"]
            assert done["mode"] == "live", done
            assert_continues(ticks(a.journal(), "main"), ticks(events_of(b["state_dir"]), "main"))
            r = cli(docker_env, "fork", a.url, "--snapshot", snap, "--host", "docker", "--trust-key", "/nonexistent")
            assert r.returncode == 2 and "--trust-key /nonexistent" in r.stderr, r.stderr
        finally:
            for name in {b["name"] for b in boxes_by_url(docker_env).values()} - before:
                docker(docker_env, "rm", "--force", name, check=False)
