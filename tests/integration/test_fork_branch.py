"""A fork of a live branch (op fork with `branch`, the CLI's `fork --branch`, the agent channel's
fork): its copies restore from the dump's images, linked into a tree of the fork's own, while the
archive is compressed, hashed and signed; they learn their snapshot once it is sealed. Real criu.

The early start is told apart from a fork after the seal by the KSM marks: copies started from
the fork's own tree mark that tree's mm images, never the snapshot's extracted ones
(<id>.d/criu/.mergeable), which a fork of the stored snapshot does mark (the control)."""
import io
import json
import os
import shutil
import subprocess
import tarfile
import time

import pytest

from sbxtest import CLI, INIT, ROOT, Session, WsBox, read_journal, run, ws_connect

needs_criu = pytest.mark.skipif(shutil.which("criu") is None or os.geteuid() != 0,
                                reason="needs root and criu on PATH")

# 24 MB of heap the copies must carry over, and a nonce only memory holds.
AGENT = ("import os, sys, time\n"
         "heap = bytearray(os.urandom(24 << 20))\n"
         "nonce = os.urandom(8).hex()\n"
         "open('/tmp/nonce', 'w').write(nonce)\n"
         "print('ready', nonce, flush=True)\n"
         "while True:\n"
         "    time.sleep(0.2)\n")


def wait_ready(box):
    box.wait_event(lambda e: e["type"] == "proc.output" and b"ready" in e.get("data", "").encode(), timeout=30)


async def exec_out(s, branch, argv, proc):
    r = await s.request("exec", proc=proc, branch=branch, argv=argv)
    assert r["ok"], r
    e = await s.wait_event(lambda e: e["type"] == "proc.exited" and e.get("proc") == proc, timeout=30)
    assert e["code"] == 0, e
    out = b"".join(x["data"].encode() for x in s.events if x["type"] == "proc.output" and x.get("proc") == proc)
    return out.decode()


async def forked(box, then, **fields):
    """Subscribes from the start, asks for a fork with `fields`, and returns `then(session, reply)`."""
    async with ws_connect(box) as ws:
        s = Session(ws)
        assert (await s.request("subscribe", since=1))["ok"]
        return await then(s, await s.request("fork", timeout=120, **fields))


def archive_criu_files(archive):
    """The criu images in a snapshot archive, by name."""
    tar = subprocess.run(["zstd", "-dc", str(archive)], capture_output=True, timeout=60, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r|") as t:
        out = {}
        for m in t:
            if m.isfile() and m.name.split("/")[0] == "criu":
                out[m.name.split("/", 1)[1]] = t.extractfile(m).read()
        return out


def output_of_branch(ev, branch):
    """What a branch's main process wrote to stdout."""
    proc = "main" if branch == "main" else "main@" + branch
    return "".join(e["data"] for e in ev if e["type"] == "proc.output" and e.get("proc") == proc
                   and e.get("stream") == "stdout")


def mergeable_marked(snapdir, snap):
    return (snapdir / f"{snap}.d" / "criu" / ".mergeable").exists()


@needs_criu
def test_a_fork_of_the_live_branch_starts_its_copies_from_the_images_and_names_the_snapshot(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", AGENT], extra=["--set", "resources.ksm=true"]) as box:
        wait_ready(box)

        async def check(s, r):
            assert r["ok"], r
            snap = r["snapshot"]
            assert snap.startswith("s-") and len(r["copies"]) == 2
            assert r["timings_ms"]["running"] <= r["timings_ms"]["total"]
            assert "checkpoint" in r["timings_ms"]
            for c in r["copies"]:
                assert c["mode"] == "live" and c["ksm"] is True, c
                # The copy continues the agent's memory, and knows its snapshot now it is sealed.
                who = json.loads(await exec_out(s, c["branch"], ["cat", "/run/sandboxer/branch.json"],
                                                "who-" + c["branch"]))
                assert who["snapshot"] == snap and who["parent"] == "main" and who["mode"] == "live"
                nonce = await exec_out(s, c["branch"], ["cat", "/tmp/nonce"], "nonce-" + c["branch"])
                assert len(nonce) == 16
            return r
        r = run(forked(box, check, branch="main", n=2, name="explore"))
        snap = r["snapshot"]
        ev = box.read_events()
        (fc,) = [e for e in ev if e["type"] == "fork.created"]
        assert fc["snapshot"] == snap and fc["early"] is True and fc["n"] == 2
        (cc,) = [e for e in ev if e["type"] == "checkpoint.created"]
        assert cc["snapshot"] == snap and cc["name"] == "explore"
        # Each copy's restore.done names the snapshot if it was sealed by then, else null; never another.
        done = [e for e in ev if e["type"] == "restore.done"]
        assert len(done) == 2 and all(d["snapshot"] in (snap, None) for d in done)
        assert all(d["snapshot"] is None for d in done if d["seq"] < cc["seq"])
        snapdir = box.state / "snapshots"
        # The copies' KSM marks went to the fork's own tree: the snapshot's images are as criu wrote
        # them, and the archive holds exactly those.
        assert not mergeable_marked(snapdir, snap)
        extracted = {p.name: p.read_bytes() for p in (snapdir / f"{snap}.d" / "criu").iterdir() if p.is_file()}
        assert archive_criu_files(snapdir / f"{snap}.tar.zst") == extracted
        # The fork's tree goes once every copy's memory has arrived.
        deadline = time.monotonic() + 30
        while list(snapdir.glob(".fork-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(snapdir.glob(".fork-*"))

        # Control: a fork of the stored snapshot starts from its extracted images, and marks them.
        async def fork_snapshot():
            async with ws_connect(box) as ws:
                return await Session(ws).request("fork", snapshot=snap, n=1, timeout=120)
        f = run(fork_snapshot())
        assert f["ok"] and f["copies"][0]["ksm"] is True, f
        assert mergeable_marked(snapdir, snap)


@needs_criu
def test_the_cli_forks_a_branch_and_bad_requests_are_refused(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", AGENT]) as box:
        wait_ready(box)

        def cli(*args):
            return subprocess.run([str(CLI), *args, "--token-file", str(box.token_file)], capture_output=True,
                                  text=True, timeout=120)
        r = cli("fork", box.url, "--branch", "main", "-n", "2", "--json")
        assert r.returncode == 0, r.stderr
        reply = json.loads(r.stdout)
        assert reply["snapshot"].startswith("s-") and [c["mode"] for c in reply["copies"]] == ["live", "live"]
        bad = cli("fork", box.url, "--branch", "main", "--snapshot", reply["snapshot"])
        assert bad.returncode != 0 and "--branch forks in the box itself: no --snapshot" in bad.stderr
        bad = cli("fork", box.url, "--snapshot", reply["snapshot"], "--name", "x")
        assert bad.returncode != 0 and "--name names the checkpoint of --branch" in bad.stderr

        async def refused():
            async with ws_connect(box) as ws:
                s = Session(ws)
                both = await s.request("fork", branch="main", snapshot=reply["snapshot"])
                nobranch = await s.request("fork", branch="nope")
                named = await s.request("fork", snapshot=reply["snapshot"], name="x")
                return both, nobranch, named
        both, nobranch, named = run(refused())
        assert both["error"]["code"] == "bad_request" and "a snapshot or a branch" in both["error"]["message"]
        assert nobranch["error"]["code"] == "no_such_branch"
        assert named["error"]["code"] == "bad_request" and "only with branch" in named["error"]["message"]
        assert box.alive()


def test_a_new_supervisor_removes_the_work_and_fork_trees_a_killed_one_left(tmp_path):
    snapdir = tmp_path / "state" / "snapshots"
    for d in (".fork-0a1b2c/criu", ".work-9f8e/payload/fs", "s-0123456789abcdef.d/criu"):
        (snapdir / d).mkdir(parents=True)
        (snapdir / d / "pages-1.img").write_bytes(b"x" * 4096)
    with WsBox(tmp_path, ["sleep", "30"]) as box:
        box.wait_event(lambda e: e["type"] == "proc.started")
        left = sorted(p.name for p in snapdir.iterdir())
    # The leftovers are gone; a snapshot's extraction (not a leftover) stays.
    assert ".fork-0a1b2c" not in left and ".work-9f8e" not in left
    assert "s-0123456789abcdef.d" in left


@needs_criu
def test_copies_run_on_when_their_snapshot_cannot_be_kept(tmp_path):
    """The state dir is a 64 MiB tmpfs with journal.disk_cap 36M; the agent holds 16 MiB of random
    heap. The dump (~20 MB) still leaves the journal its room, so the copies start from it; the
    archive (~17 MB more) would not, so the snapshot is not kept. The copies run on, the reply
    says why, and nothing of the snapshot stays once their memory has arrived."""
    agent = AGENT.replace("24 << 20", "16 << 20")
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state)], check=True)
    try:
        with WsBox(tmp_path, ["python3", "-c", agent], extra=["--set", "journal.disk_cap=36M"]) as box:
            wait_ready(box)

            async def nonces_of(s, r):
                return r, [await exec_out(s, c["branch"], ["cat", "/tmp/nonce"], "n-" + c["branch"])
                           for c in r.get("copies", [])]
            r, nonces = run(forked(box, nonces_of, branch="main", n=2))
            assert r["ok"] and r["snapshot"] is None, r
            assert "not kept" in r["note"] and "kept for the journal first" in r["note"], r
            assert len(nonces) == 2 and all(len(n) == 16 for n in nonces)
            ev = box.read_events()
            (failed,) = [e for e in ev if e["type"] == "checkpoint.failed"]
            assert failed["error"]["code"] == "no_space", failed
            (fc,) = [e for e in ev if e["type"] == "fork.created"]
            assert fc["snapshot"] is None and len(fc["copies"]) == 2
            snapdir = state / "snapshots"
            deadline = time.monotonic() + 30
            while list(snapdir.glob(".fork-*")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not list(snapdir.glob(".fork-*")) and not list(snapdir.glob("s-*"))
            assert not list(snapdir.glob(".work-*"))
            assert box.alive()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


# Forks itself through its agent channel with 64 MB of heap (a seal long enough that its copies
# usually run before it ends) and says what its fork() returned and who it is.
CHANNEL_AGENT = ("import json, os, sys, time\n"
                 "sys.path.insert(0, os.environ['SBX_AGENT_SDK'])\n"
                 "import agent\n"
                 "heap = bytearray(os.urandom(64 << 20))\n"
                 "ch = agent.Channel()\n"
                 "r = ch.fork(2, name='chan')\n"
                 "print(json.dumps({'copy': r.get('copy'), 'snapshot': r.get('snapshot'),\n"
                 "                  'who': ch.whoami()['snapshot'], 'file': agent.branch_info()['snapshot']}),\n"
                 "      flush=True)\n"
                 "time.sleep(0.5)\n")


@needs_criu
def test_a_copy_of_a_channel_fork_hears_its_snapshot_when_its_fork_returns(tmp_path):
    env = dict(os.environ, SBX_AGENT_SDK=str(ROOT / "sdk" / "python" / "sandboxer"))
    state = tmp_path / "s"
    r = subprocess.run([str(INIT), "--state-dir", str(state), "--env", "SBX_AGENT_SDK", "--", "python3", "-c",
                        CHANNEL_AGENT], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    ev = read_journal(state)
    (cc,) = [e for e in ev if e["type"] == "checkpoint.created"]
    (fc,) = [e for e in ev if e["type"] == "fork.created"]
    assert fc["early"] is True and fc["snapshot"] == cc["snapshot"]
    said = {e["branch"]: json.loads(output_of_branch(ev, e["branch"])) for e in ev
            if e["type"] == "proc.exited" and e["branch"] in ("main", "f1", "f2")}
    assert set(said) == {"main", "f1", "f2"}, said
    for branch, m in said.items():
        # Every branch's fork() returned naming the sealed snapshot; a copy's whoami and branch.json
        # name it too (the original's own lineage is that it has none).
        assert m["snapshot"] == cc["snapshot"] and m["copy"] is (branch != "main"), (branch, m)
        if branch != "main":
            assert m["who"] == m["file"] == cc["snapshot"], (branch, m)


@needs_criu
@pytest.mark.parametrize("mode", ["none", "host"])
def test_a_copy_of_a_copy_execs_with_pipes_and_a_pty_in_its_own_network_namespace(tmp_path, mode):
    # ns-init's reports (a socket: exec'd processes' fds come with them) cross every restore: the
    # copy's ns-init gets a new one (criu --inherit-fd socket:[INO]), made in the copy's network
    # namespace, so that the copy is checkpointed again (criu dumps a unix socket only from the
    # tree's network namespaces; a branch's own is dumped as external). `none`: the original
    # has a network namespace of its own too; `host`: it has the host's, its copies their own.
    with WsBox(tmp_path, ["python3", "-c", AGENT], extra=["--set", f"network.mode={mode}"]) as box:
        wait_ready(box)

        async def go():
            async with ws_connect(box) as ws:
                s = Session(ws)
                assert (await s.request("subscribe", since=1))["ok"]
                branch = "main"
                for level in (1, 2):
                    r = await s.request("fork", branch=branch, n=1, timeout=120)
                    assert r["ok"] and r["copies"][0]["mode"] == "live", r
                    branch = r["copies"][0]["branch"]
                    dev = await exec_out(s, branch, ["cat", "/proc/net/dev"], f"net-{level}")
                    assert [x.split(":")[0].strip() for x in dev.splitlines()[2:]] == ["lo"], dev
                    # Its /sys/fs/cgroup is its own group (criu given the copy's at restore): the
                    # group holds its processes; the original's would list none of this pid namespace.
                    procs = await exec_out(s, branch, ["sh", "-c", "cat /sys/fs/cgroup/pids/cgroup.procs 2>/dev/null ||"
                                                       " cat /sys/fs/cgroup/cgroup.procs"], f"cg-{level}")
                    assert "1" in procs.split(), procs
                    # A cgroup namespace rooted at those groups (criu started in it): no host path.
                    cg = await exec_out(s, branch, ["cat", "/proc/self/cgroup"], f"cgns-{level}")
                    assert cg and all(line.endswith(":/") for line in cg.splitlines()), cg
                    t = await s.request("exec", proc=f"tty-{level}", branch=branch, tty=True, cols=70, rows=21,
                                        argv=["sh", "-c", "read x; echo got $x; stty size"])
                    assert t["ok"] and t["tty"], t
                    await s.request("stdin", proc=f"tty-{level}", branch=branch, data="it\n")
                    e = await s.wait_event(lambda e: e["type"] == "proc.exited" and e.get("proc") == f"tty-{level}",
                                           timeout=30)
                    out = "".join(x["data"] for x in s.events if x["type"] == "proc.output"
                                  and x.get("proc") == f"tty-{level}")
                    assert e["code"] == 0 and "got it" in out and "21 70" in out, (e, out)
        run(go(), 240)


FORK_AND_END = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["SBX_AGENT_SDK"])
import agent
ch = agent.Channel()
for i in range(int(sys.argv[1])):
    r = ch.fork(1)
    if r.get("copy"):
        open("/workspace/mine", "w").write(ch.identity["branch"])
        sys.exit(0)
    ch.delete_snapshot(r["snapshot"])
    print(json.dumps({"forked": i + 1}), flush=True)
time.sleep(600)
'''


def copy_groups(box_id):
    """The cgroups of the box's copies (sbx-ID-f1, ...), in any hierarchy."""
    groups = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        if root.count("/") > 8:
            dirs[:] = []
        groups += [d for d in dirs if d.startswith(f"sbx-{box_id}-f")]
    return groups


@needs_criu
def test_ended_copies_give_back_their_fds_and_cgroups_and_keep_their_files(tmp_path):
    # Fork-and-explore: the agent forks 30 times, each copy writes a file and exits. Every ended
    # copy kept ~10 of the supervisor's fds (ns-init's pipes, the agent channel, its network
    # namespace) and its cgroups: about 2,000 copies from the fd limit, one group a hierarchy
    # each for the box's life. They are released at the copy's end; its dir and files stay.
    env = dict(os.environ, SBX_AGENT_SDK=str(ROOT / "sdk" / "python" / "sandboxer"))
    with WsBox(tmp_path, ["python3", "-c", FORK_AND_END, "30"], extra=["--env", "SBX_AGENT_SDK"], env=env) as box:
        def copies_ended(n):
            box.wait_event(lambda e: e["type"] == "proc.exited" and e["proc"] == f"main@f{n}", timeout=120)
            time.sleep(0.2)  # the release comes a loop turn after proc.exited
            return len(os.listdir(f"/proc/{box.proc.pid}/fd"))

        fds_3 = copies_ended(3)
        fds_30 = copies_ended(30)
        assert fds_30 - fds_3 <= 5, (fds_3, fds_30)
        started = box.wait_event(lambda e: e["type"] == "box.started")
        assert copy_groups(started["box"]) == []

        async def files():
            async with ws_connect(box) as ws:
                s = Session(ws)
                return [await s.request("fs.stat", branch=f"f{n}", path="/workspace/mine") for n in (1, 30)]
        for st in run(files(), 60):
            assert st["ok"] and st["size"] in (2, 3), st


FORK_AND_STAY = '''
import json, sys, time
sys.path.insert(0, __import__("os").environ["SBX_AGENT_SDK"])
import agent
ch = agent.Channel()
for i in range(2):
    if ch.fork(1).get("copy"):
        break
    print(json.dumps({"forked": i + 1}), flush=True)
time.sleep(600)
'''


@needs_criu
def test_the_next_run_removes_the_cgroups_of_a_killed_supervisors_copies(tmp_path):
    # A supervisor KILLed (the host's OOM killer) removes none of its groups. Main's was found by
    # the next run on the state dir (the same box id), but its copies' stayed for good, a group a
    # hierarchy each. The next run removes every group of the box before it makes its own.
    env = dict(os.environ, SBX_AGENT_SDK=str(ROOT / "sdk" / "python" / "sandboxer"))
    with WsBox(tmp_path, ["python3", "-c", FORK_AND_STAY], extra=["--env", "SBX_AGENT_SDK"], env=env) as box:
        box.wait_event(lambda e: e["type"] == "proc.output" and '"forked": 2' in e.get("data", ""), timeout=120)
        box_id = box.wait_event(lambda e: e["type"] == "box.started")["box"]
        assert {g.rsplit("-", 1)[1] for g in copy_groups(box_id)} == {"f1", "f2"}, copy_groups(box_id)
        box.proc.kill()
        box.proc.wait(30)
        time.sleep(0.2)  # the copies' ns-init end by their parent-death signal
        left = copy_groups(box_id)
        assert left, "control: a killed supervisor's copies' groups stay"
        r = subprocess.run([str(INIT), "--state-dir", str(box.state), "--", "/bin/true"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        assert copy_groups(box_id) == [], copy_groups(box_id)
        for name in {*left}:
            assert f"removed cgroup {name}, which an earlier run of this box left" in r.stderr, r.stderr[-2000:]
        # Their files stay with their dirs.
        assert (box.state / "branches" / "f1" / "workspace").is_dir()
