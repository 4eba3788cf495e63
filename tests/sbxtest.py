"""What the tests share besides pytest fixtures, in one place: the built binaries, one way to run a
box to its end and one to start a box serving the WebSocket API, one journal reader and one "wait
for an event", the WebSocket client helpers, and the test TLS certificates and HTTPS stand-ins.

A module of its own rather than conftest.py: tests/sdk_python has a conftest.py too, and two
modules both named `conftest` cannot both be imported by that name in one pytest run. Every test
directory can import it: tests/conftest.py puts tests/ on sys.path."""
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import pathlib
import random
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = pathlib.Path(os.environ.get("SANDBOXER_BUILD", ROOT / "build"))


def sanitized():
    """True for a build under the sanitizers (scripts/sanitize): its memory is ASan's to account
    (redzones, freed blocks held in quarantine), not the supervisor's alone."""
    cache = BUILD / "CMakeCache.txt"
    return cache.exists() and "SBX_SANITIZE:BOOL=ON" in cache.read_text()
BIN = BUILD / "bin"
INIT = BIN / "sandboxer-init"
CLI = BIN / "sandboxer"
PROBE = BIN / "sbx-testprobe"

SUBPROTOCOL = "sandboxer.v1"


# -- the journal and its events ---------------------------------------------------------------

def mounts_below(path):
    """The mount points at `path` or below it in this process's mount namespace, in mount order
    (a box's mounts that outlived it show here)."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    return [p for p in points if p == path or p.startswith(path + "/")]


def unmount_below(path):
    """What a failed test left mounted at or below `path`, lazily, the last mounted first."""
    for m in reversed(mounts_below(path)):
        subprocess.run(["umount", "-l", m])


def free_port_pair():
    """An even port p with p and p + 1 free on 127.0.0.1 now, below the kernel's ephemeral range,
    where the connections of the tests running beside this one take theirs (a random pick in
    20000-40000 once met one of them: "Address already in use")."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(200):
        p = random.randrange(10000, max(10002, min(low, 30000) - 2), 2)
        held = []
        try:
            for q in (p, p + 1):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no two free ports found on 127.0.0.1")


def read_journal(state_dir, since=0):
    """Every event of a box's journal, through `sandboxer log --json` (the reader users have)."""
    out = subprocess.run([str(CLI), "log", str(state_dir), "--json", "--since", str(since)],
                         check=True, capture_output=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def read_events(path):
    """The events a running box has written so far to its `--events` file (none before it exists;
    a last line still being written is left for the next read)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def wait_event(path, pred, timeout=30):
    """The first event of the `--events` file at `path` for which `pred` holds, polled until
    `timeout` seconds have passed (then TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        for e in read_events(path):
            if pred(e):
                return e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no such event in {path} within {timeout}s")
        time.sleep(0.02)


def of_type(events, t):
    return [e for e in events if e["type"] == t]


def started(events):
    return of_type(events, "box.started")[0]


def exited(events):
    ex = of_type(events, "proc.exited")
    assert len(ex) == 1, ex
    return ex[0]


def output(events, stream="stdout"):
    """The text the box's processes wrote to `stream`."""
    return "".join(e.get("data", "") for e in events if e["type"] == "proc.output" and e["stream"] == stream)


def output_of(events, proc):
    """The bytes process `proc` wrote, both streams in order."""
    buf = bytearray()
    for e in events:
        if e["type"] == "proc.output" and e.get("proc") == proc:
            buf += e["data"].encode() if "data" in e else base64.b64decode(e["data_b64"])
    return bytes(buf)


# -- a box run to its end ---------------------------------------------------------------------

def clean_env(path="/usr/bin:/bin", **extra):
    """A clean environment for a supervisor: PATH and `extra`, and conftest.py's
    SANDBOXER_HEALTH_FILE, so that one running as PID 1 writes its health file there and not
    over the host's /run/sandboxer/init.json."""
    env = {"PATH": path, **extra}
    if "SANDBOXER_HEALTH_FILE" in os.environ:
        env["SANDBOXER_HEALTH_FILE"] = os.environ["SANDBOXER_HEALTH_FILE"]
    return env


def run_init(args, state_dir, *, as_pid1=True, timeout=60, **kw):
    """Runs sandboxer-init (as PID 1 of a fresh pid namespace unless as_pid1=False)."""
    cmd = [str(INIT), "--state-dir", str(state_dir)] + list(args)
    if as_pid1:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc"] + cmd
    return subprocess.run(cmd, timeout=timeout, capture_output=True, **kw)


def maps_while_sleeping(tmp_path, name, extra_args, env=None):
    """The supervisor's /proc/PID/maps once its agent (sleep) has started: which libraries a box
    started with `extra_args` has loaded."""
    events = tmp_path / f"{name}.jsonl"
    p = subprocess.Popen([str(INIT), "--state-dir", str(tmp_path / name), "--events", str(events), *extra_args,
                          "--", "sleep", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        wait_event(events, lambda e: e["type"] == "proc.started", timeout=20)
        maps = open(f"/proc/{p.pid}/maps").read()
        assert "sandboxer-init" in maps  # the right process's maps
        return maps
    finally:
        p.kill()
        p.wait()


def refused_without_library(tmp_path, soname, args, expect, env=None):
    """On a host whose loader finds `soname` first where it is no library (LD_LIBRARY_PATH), a box
    started with `args` (an agent that would sleep 120 s) ends at once, its error holding every
    string of `expect`; the same host runs a box that needs no such library (the control)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / soname).write_text("not a shared object\n")
    env = dict(env or os.environ, LD_LIBRARY_PATH=str(lib))
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "refused"), *args, "--", "sleep", "120"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0, r.stderr
    for e in expect:
        assert e in r.stderr, r.stderr
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "plain"), "--", "sh", "-c", "echo ran"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert any(e["type"] == "proc.output" and e["data"] == "ran\n" for e in read_journal(tmp_path / "plain"))


def box(state_dir, argv, *sets, profile=None, timeout=60, env=None):
    """Runs one box to its end (sandboxer-init as PID 1 of a fresh pid namespace) with profile
    overrides; returns the completed process and the journal's events."""
    args = []
    if profile:
        args += ["--profile", profile]
    for s in sets:
        args += ["--set", s]
    r = run_init(args + ["--"] + [str(a) for a in argv], state_dir, timeout=timeout, env=env)
    return r, read_journal(state_dir)


def probe(*args):
    """The argv of the test probe (tests/helper/testprobe.c) with `args`."""
    return [str(PROBE)] + [str(a) for a in args]


# -- a box serving the WebSocket API ----------------------------------------------------------

class WsBox:
    """The real sandboxer-init with `--listen 127.0.0.1:0` and a token file, running `argv` as its
    agent; its port comes from the `server.listening` event of its `--events` file. With
    `as_pid1` it is PID 1 of a fresh pid namespace (as in a container), and `stop` ends the whole
    process group; `mount_proc=False` leaves it the host's /proc there. `metrics=None` keeps the
    profile's cadence of metrics events. `wrap` is a command that runs it (its argv comes after).
    `init` is another sandboxer-init (an install of the build's programs elsewhere)."""

    def __init__(self, tmp_path, argv, *, extra=(), env=None, metrics="0", as_pid1=False, mount_proc=True, wrap=(),
                 init=INIT):
        self.dir = pathlib.Path(tmp_path)
        self.state = self.dir / "state"
        self.events = self.dir / "events.jsonl"
        self.token = secrets.token_hex(16)
        self.token_file = self.dir / "token"
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        self.as_pid1 = as_pid1
        cmd = [str(init), "--state-dir", str(self.state), "--events", str(self.events),
               "--listen", "127.0.0.1:0", "--token-file", str(self.token_file),
               "--log-level", os.environ.get("SBX_TEST_LOG", "info"),
               *(["--metrics-interval", metrics] if metrics is not None else []), *extra, "--", *argv]
        cmd = [*wrap, *cmd]  # a command that runs sandboxer-init (sbx-testprobe deny ...)
        if as_pid1:
            cmd = ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []), "--kill-child", *cmd]
        self.stderr_path = self.dir / "init.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                     env=env, start_new_session=True)
        self.port = self._wait_port()
        self.url = f"ws://127.0.0.1:{self.port}"

    def _wait_port(self, timeout=15):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in read_events(self.events):
                if ev["type"] == "server.listening":
                    return ev["port"]
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxer-init exited {self.proc.returncode}: {self.stderr()}")
            time.sleep(0.02)
        raise TimeoutError(f"no server.listening event: {self.stderr()}")

    @property
    def workspace(self):
        return self.state / "branches" / "main" / "workspace"

    def read_events(self):
        """The events written so far (the `--events` file)."""
        return read_events(self.events)

    def wait_event(self, pred, timeout=30):
        """The first event written for which `pred` holds (TimeoutError after `timeout` s)."""
        return wait_event(self.events, pred, timeout)

    def stderr(self):
        """The end of sandboxer-init's stderr so far."""
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def alive(self):
        return self.proc.poll() is None

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            try:
                if self.as_pid1:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                else:
                    self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL) if self.as_pid1 else self.proc.kill()
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._stderr.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.stop()


PIDS_V1 = pathlib.Path("/sys/fs/cgroup/pids")

# An agent's first lines (Python): it forks sleepers until the kernel refuses, and keeps their pids
# in `kids`; what it does at its ceiling follows.
FORK_UNTIL_REFUSED = r'''
import os, time
kids = []
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv("/bin/sleep", ["sleep", "600"])
    kids.append(pid)
'''


def pids_running(*argv):
    """Pids of the host's processes whose command line is exactly `argv` (zombies left out):
    for a process a test made unique by its arguments (`sleep 612.345`)."""
    want = "".join(f"{a}\0" for a in argv).encode()
    found = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes() == want:
                stat = (d / "stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":
                    found.append(int(d.name))
        except (OSError, ValueError):
            pass
    return found


@contextlib.contextmanager
def pids_group():
    """A cgroup v1 pids group of the test's own (as a container's one pids limit for the box):
    yields its directory; at the end, every process still in it is killed and the group removed."""
    cg = PIDS_V1 / f"sbx-test-{os.getpid()}-{time.monotonic_ns()}"
    cg.mkdir()
    try:
        yield cg
    finally:
        for _ in range(100):
            pids = (cg / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
        cg.rmdir()


@contextlib.contextmanager
def overlayfs_dir(tmp_path):
    """A directory on an overlay filesystem of the test's own (as a container's root is), where
    another overlay's upper directory is refused: yields it; unmounted at the end."""
    for d in ("lower", "upper", "work", "mnt"):
        (tmp_path / d).mkdir()
    mnt = tmp_path / "mnt"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={tmp_path}/lower,upperdir={tmp_path}/upper,"
                    f"workdir={tmp_path}/work", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


# -- WebSocket clients ------------------------------------------------------------------------

def auth_headers(token):
    return {"Authorization": f"Bearer {token}"}


def ws_connect(box, *, token=None, header=True, **kw):
    from websockets.asyncio.client import connect
    kw.setdefault("max_size", 64 << 20)
    # A client that stops reading with a backlog cannot see the close answer behind it: do not wait long.
    kw.setdefault("close_timeout", 1)
    return connect(box.url, subprotocols=[SUBPROTOCOL], additional_headers=auth_headers(token or box.token) if header else {},
                   open_timeout=10, **kw)


class Session:
    """Requests with ids; events set aside as they arrive."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 1
        self.events = []
        self.binary = []

    async def recv_one(self, timeout=30):
        m = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(m, bytes):
            self.binary.append(m)
            return None
        obj = json.loads(m)
        if "seq" in obj and "id" not in obj:
            self.events.append(obj)
            return None
        return obj

    async def request(self, op, timeout=30, **fields):
        rid = fields.pop("id", None)
        if rid is None:
            rid = self.next_id
            self.next_id += 1
        await self.ws.send(json.dumps({"id": rid, "op": op, **fields}))
        return await self.reply(rid, timeout)

    async def reply(self, rid, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to {rid}")
            r = await self.recv_one(left)
            if r is not None and r.get("id") == rid:
                return r

    async def wait_event(self, pred, timeout=30):
        deadline = time.monotonic() + timeout
        for e in self.events:
            if pred(e):
                return e
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("event not seen")
            n = len(self.events)
            await self.recv_one(left)
            for e in self.events[n:]:
                if pred(e):
                    return e


# An agent that holds a write lease on /workspace/leased (SIGIO ignored: the lease's break is
# signalled, and kept, not obeyed), makes /workspace/ready, then prints "alive" every 0.1 s.
LEASE_AGENT = r'''
import fcntl, os, signal, time
signal.signal(signal.SIGIO, signal.SIG_IGN)
fd = os.open("/workspace/leased", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"held")
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
open("/workspace/ready", "w").close()
while True:
    time.sleep(0.1)
    print("alive", flush=True)
'''


async def wait_for_path(s, path, timeout=10):
    """Asks `fs.stat` of `path` over the Session `s` until the box has it."""
    deadline = time.monotonic() + timeout
    while not (await s.request("fs.stat", path=path))["ok"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        await asyncio.sleep(0.05)


def run(coro, timeout=120):
    """Runs a coroutine to completion within `timeout` seconds."""
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())


async def follow(box, until, since=0, timeout=120):
    """Subscribes from `since` and reads until `until(event)`, resuming after a 4008 (too slow)
    from the last seq seen, as the SDKs do. Returns every event seen, each once."""
    from websockets.exceptions import ConnectionClosed
    events = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with ws_connect(box) as ws:
                s = Session(ws)
                await s.request("subscribe", since=events[-1]["seq"] if events else since)
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("follow: condition not met")
                    n = len(s.events)
                    await s.recv_one(left)
                    for e in s.events[n:]:
                        events.append(e)
                        if until(e):
                            return events
        except ConnectionClosed as e:
            if e.rcvd is None or e.rcvd.code != 4008:
                raise


# -- TLS: a test CA, its server certificate, and HTTPS stand-ins ------------------------------

class Tls(NamedTuple):
    ca: pathlib.Path    # the test CA's certificate: what a client trusts
    cert: pathlib.Path  # the server's certificate, signed by the CA
    key: pathlib.Path   # the server's private key


def make_tls(d, names=("api.example.test",)):
    """A test CA and a server certificate it signs for `names` (host names, or IP addresses such
    as 127.0.0.1), by the openssl CLI, in directory `d`. P-256 keys: quick to make."""
    d = pathlib.Path(d)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, timeout=30)  # noqa: E731
    openssl("req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.pem", "-days", "2", "-subj", "/CN=sbx test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *ec, "-keyout", d / "srv.key", "-out", d / "srv.csr", "-subj", "/CN=" + names[0])
    alt = ",".join(("IP:" if n.replace(".", "").isdigit() or ":" in n else "DNS:") + n for n in names)
    (d / "ext.cnf").write_text(f"subjectAltName={alt}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", d / "srv.csr", "-CA", d / "ca.pem", "-CAkey", d / "ca.key", "-CAcreateserial",
        "-out", d / "srv.pem", "-days", "2", "-extfile", d / "ext.cnf")
    return Tls(d / "ca.pem", d / "srv.pem", d / "srv.key")


def serve_http(server, tls=None):
    """Serves an http.server on a daemon thread, over TLS with `tls` (a Tls from make_tls) when
    given; returns the server (its port: `server.server_address[1]`; stop: `close_http`)."""
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls.cert, tls.key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def close_http(server):
    server.shutdown()
    server.server_close()


# -- private dockerds (scripts/dockerd) -------------------------------------------------------

def start_dockerd(d, **env):
    """scripts/dockerd start D with `env` added (DOCKERD_NETNS, DOCKERD_TCP, ...); its DOCKER_HOST."""
    out = subprocess.run([str(ROOT / "scripts" / "dockerd"), "start", str(d)], capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split("=", 1)[1]


def stop_dockerd(d, env=None):
    """Removes every container of the dockerd `env` points at (if given), stops the dockerd of D and
    removes D (its image layers need not wait for pytest's rotation of old tmp dirs)."""
    if env is not None:
        ids = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True, text=True).stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], env=env, capture_output=True, timeout=120)
    # `stop` also unmounts what dockerd left mounted under d (its default netns file).
    subprocess.run([str(ROOT / "scripts" / "dockerd"), "stop", str(d)], capture_output=True, timeout=120)
    shutil.rmtree(d, ignore_errors=True)


def checkpoint_and_export(box, out, timeout=120):
    """`sandboxer checkpoint` of `box` (a WsBox, or anything with url and token_file), then
    `sandboxer export` of that snapshot to `out`: returns the snapshot's id."""
    r = subprocess.run([str(CLI), "checkpoint", box.url, "--token-file", str(box.token_file)],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    snap = r.stdout.strip().splitlines()[-1]
    e = subprocess.run([str(CLI), "export", box.url, snap, str(out), "--token-file", str(box.token_file)],
                       capture_output=True, text=True, timeout=timeout)
    assert e.returncode == 0, e.stderr
    return snap


def silent_websocket_server(answer=None, received=None):
    """A server on 127.0.0.1 that completes the WebSocket handshake and then never answers:
    returns its listening socket. With `answer` (bytes, under 126), it sends that as the payload
    of one text frame once the client has sent something, then answers nothing more; the bytes
    the client sends after it are appended to the list `received`, and None once it has closed."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        key = re.search(rb"Sec-WebSocket-Key: *(\S+)", head, re.I).group(1)
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\nSec-WebSocket-Protocol: sandboxer.v1\r\n\r\n")
        with contextlib.suppress(OSError):
            if answer is not None and conn.recv(65536):
                conn.sendall(b"\x81" + bytes([len(answer)]) + answer)
            while data := conn.recv(65536):
                if received is not None:
                    received.append(data)
        if received is not None:
            received.append(None)
    threading.Thread(target=serve, daemon=True).start()
    return srv


class FrameProxy:
    """A TCP proxy on 127.0.0.1 in front of a box. The server's bytes after the HTTP upgrade are
    read as WebSocket frames (unmasked, server to client), so the proxy can act on the archive:
    `cut` closes both sides once that many payload bytes of binary frames have passed; `flip`
    inverts one payload byte of the second binary frame and forwards the rest as it came; `drop`
    leaves out the binary frame of that number (1: the first). `cut_up` closes both sides of a
    connection once the client has sent that many bytes on it (an upload cut off).
    `largest_text` is the size of the largest text message the server has sent."""

    def __init__(self, port, *, cut=None, flip=False, drop=None, cut_up=None):
        self.port, self.cut, self.flip, self.drop, self.cut_up = port, cut, flip, drop, cut_up
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"ws://127.0.0.1:{self.listener.getsockname()[1]}"
        self.binary_bytes = 0
        self.largest_text = 0
        self.acted = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._frames, args=(server, client), daemon=True).start()

    def _pipe(self, src, dst):
        sent = 0
        try:
            while data := src.recv(65536):
                if self.cut_up is not None and sent + len(data) >= self.cut_up:
                    self.acted = True
                    for s in (src, dst):
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)
                    return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _frames(self, server, client):
        buf = b""

        def need(n):
            nonlocal buf
            while len(buf) < n:
                data = server.recv(65536)
                if not data:
                    raise EOFError
                buf += data

        try:
            need(4)
            while b"\r\n\r\n" not in buf:
                need(len(buf) + 1)
            end = buf.index(b"\r\n\r\n") + 4
            client.sendall(buf[:end])
            buf = buf[end:]
            binary_frames = 0
            text, in_text = 0, False  # the text message being read: its bytes so far
            while True:
                need(2)
                length, head = buf[1] & 0x7F, 2
                if length == 126:
                    need(4)
                    length, head = int.from_bytes(buf[2:4], "big"), 4
                elif length == 127:
                    need(10)
                    length, head = int.from_bytes(buf[2:10], "big"), 10
                need(head + length)
                frame, buf = bytearray(buf[:head + length]), buf[head + length:]
                opcode = frame[0] & 0x0F
                if opcode in (0, 1, 2):
                    in_text = opcode == 1 or (opcode == 0 and in_text)
                    text = (length if opcode == 1 else text + length) if in_text else 0
                    if in_text and frame[0] & 0x80:
                        self.largest_text = max(self.largest_text, text)
                if opcode == 2:
                    binary_frames += 1
                    if self.flip and binary_frames == 2 and length > 20:
                        frame[-1] ^= 0xFF  # the payload's last byte, past the 13-byte header
                        self.acted = True
                    if self.cut is not None and self.binary_bytes + length > self.cut:
                        self.acted = True
                        raise EOFError
                    self.binary_bytes += length
                    if self.drop == binary_frames:
                        self.acted = True
                        continue
                client.sendall(bytes(frame))
        except (EOFError, OSError):
            pass
        for s in (client, server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self):
        self.listener.close()
