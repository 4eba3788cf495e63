"""What several benchmarks share: a free loopback port and a private dockerd for one run."""
import contextlib
import os
import socket
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@contextlib.contextmanager
def private_dockerd(prefix, experimental=False):
    """scripts/dockerd with a data root under a fresh temporary dir; yields (work dir, env with
    DOCKER_HOST). At the end: every container removed, dockerd stopped, the dir gone."""
    work = tempfile.mkdtemp(prefix=prefix)
    extra = {"DOCKERD_EXPERIMENTAL": "1"} if experimental else {}
    out = subprocess.run([os.path.join(ROOT, "scripts", "dockerd"), "start", os.path.join(work, "d")],
                         capture_output=True, text=True, check=True, env=dict(os.environ, **extra))
    env = dict(os.environ, DOCKER_HOST=out.stdout.strip().splitlines()[-1].split("=", 1)[1])
    try:
        yield work, env
    finally:
        ids = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True, text=True).stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], env=env, capture_output=True)
        subprocess.run([os.path.join(ROOT, "scripts", "dockerd"), "stop", os.path.join(work, "d")],
                       capture_output=True)
        subprocess.run(["rm", "-rf", work])
