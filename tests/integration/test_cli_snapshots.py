"""The CLI's snapshot commands over the WebSocket: checkpoint a live agent, list, fork."""
import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from sbxtest import (CLI, FORK_UNTIL_REFUSED, PIDS_V1, Session, WsBox, output_of, overlayfs_dir, pids_group, read_journal,
                     run, ws_connect)

# A counter that keeps its state in memory only: a copy that continues from the checkpoint
# prints numbers after the one it was at, which a cold restart cannot do.
COUNTER = ("import time, sys\n"
           "n = 0\n"
           "while True:\n"
           "    n += 1\n"
           "    print(n, flush=True)\n"
           "    time.sleep(0.1)\n")


def cli(box, *args, timeout=120):
    return subprocess.run([str(CLI), *args, "--token-file", str(box.token_file)], capture_output=True, text=True,
                          timeout=timeout)


def text_of(box, branch):
    """Everything the branch's agent wrote, in order (a line may span several proc.output events)."""
    events = box.read_events()
    return output_of(events, "main" if branch == "main" else "main@" + branch).decode(errors="replace")


def outputs(box, branch):
    """The numbers of the complete lines the branch's counter printed."""
    text = text_of(box, branch)
    return [int(x) for x in text[:text.rfind("\n") + 1].split()]


def checkpoint_and_fork(box, n, branch=None):
    """A checkpoint of the box's agent (or of `branch`'s) after it has run a moment, then n copies
    of it: the branches of the copies."""
    time.sleep(0.8)
    r = cli(box, "checkpoint", box.url, *(["--branch", branch] if branch else []))
    assert r.returncode == 0, r.stderr
    f = cli(box, "fork", box.url, "--snapshot", r.stdout.strip().splitlines()[-1], "-n", str(n))
    assert f.returncode == 0, f.stderr
    branches = [line.split()[0] for line in f.stdout.splitlines()]
    assert len(branches) == n, f.stdout
    return branches


def wait_for_output(box, branch, text, timeout=15):
    """Waits until the branch's agent has written `text`; fails showing what it wrote."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and text not in text_of(box, branch):
        time.sleep(0.2)
    assert text in text_of(box, branch), (branch, text_of(box, branch)[-300:])


def test_checkpoint_then_fork_two_live_copies(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(1.0)
        r = cli(box, "checkpoint", box.url, "--name", "cli")
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip().splitlines()[-1]
        assert snap.startswith("s-"), r.stdout
        # For a person: what was made, its size, the agent's pause (it printed `checkpoint: mode "live"`).
        assert re.fullmatch(rf"sandboxer checkpoint: {snap} live \([0-9.]+ (KiB|MiB); the agent paused [0-9.]+ ms, "
                            r"[0-9.]+ ms in all\)\n", r.stderr), r.stderr
        listed = cli(box, "snapshots", box.url)
        assert listed.returncode == 0 and snap in listed.stdout
        # One line each for a person: the id, when, the branch, the mode, the size, the name (the
        # whole manifest, a screenful of JSON each, was all it printed); --json gives the manifests.
        head, row = listed.stdout.splitlines()
        assert head.split() == ["SNAPSHOT", "CREATED", "(UTC)", "BRANCH", "MODE", "SIZE", "BY", "NAME"], head
        cols = row.split()
        assert cols[0] == snap and cols[3:5] == ["main", "live"] and cols[6] in ("KiB", "MiB"), row
        assert cols[7:] == ["operator", "cli"], row
        as_json = [json.loads(line) for line in cli(box, "snapshots", box.url, "--json").stdout.splitlines()]
        assert [m["id"] for m in as_json] == [snap] and as_json[0]["name"] == "cli"
        at_checkpoint = max(outputs(box, "main"))
        f = cli(box, "fork", box.url, "--snapshot", snap, "-n", "2")
        assert f.returncode == 0, f.stderr
        branches = [line.split()[0] for line in f.stdout.splitlines()]
        assert len(branches) == 2 and len(set(branches)) == 2 and "main" not in branches
        time.sleep(1.5)
        for b in branches:
            seen = list(outputs(box, b))
            assert seen, f"copy {b} printed nothing"
            # It continues from memory: its first number follows the checkpoint's count closely.
            assert seen[0] > 1 and seen[0] <= at_checkpoint + 2, (b, seen[:3], at_checkpoint)
        # A refused request is a clear error and a non-zero exit.
        bad = cli(box, "fork", box.url, "--snapshot", "s-0000000000000000", "-n", "1")
        assert bad.returncode != 0 and "sandboxer fork:" in bad.stderr


def test_checkpoint_stop_ends_the_agent_and_the_journal_says_the_checkpoint_did(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", COUNTER]) as box:
        wait_for_output(box, "main", "3\n")
        r = cli(box, "checkpoint", box.url, "--stop")
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip().splitlines()[-1]
        assert re.fullmatch(rf"sandboxer checkpoint: {snap} live \([0-9.]+ (KiB|MiB); the agent ended, [0-9.]+ ms in "
                            r"all\)\n", r.stderr), r.stderr
        assert box.proc.wait(timeout=30) == 137
    # `run` and `log` print who ended it: a KILL with no word of why read as the OOM killer's.
    log = subprocess.run([str(CLI), "log", str(box.state)], capture_output=True, text=True, timeout=30)
    assert log.returncode == 0, log.stderr
    assert re.search(r" main exited, signal KILL \(killed by checkpoint\)\n", log.stdout), log.stdout[-500:]
    # Its numbers as a person writes them: "total":68.6, not boost::json's "total":6.86E1.
    created = next(line for line in log.stdout.splitlines() if " checkpoint.created " in line)
    assert re.search(r'"total":[0-9]+(\.[0-9]+)?[,}]', created) and not re.search(r"[0-9]E-?[0-9]", created), created
    assert any(e["type"] == "checkpoint.created" and e["snapshot"] == snap and e["leave_running"] is False
               for e in read_journal(box.state))


# The agent checkpoints itself through its channel, naming the snapshot, then counts.
NAMING_AGENT = ("import json, os\n"
                "req, rep = (int(x) for x in os.environ['SANDBOXER_CHANNEL_FD'].split(','))\n"
                "os.write(req, b'{\"id\": 1, \"op\": \"checkpoint\", \"name\": \"agents\", \"leave_running\": true}\\n')\n"
                "buf = b''\n"
                "while not buf.endswith(b'\\n'):\n"
                "    buf += os.read(rep, 65536)\n"
                "print('agent checkpoint', json.loads(buf)['ok'], flush=True)\n") + COUNTER


def test_a_snapshot_is_named_by_its_name_where_exactly_one_has_it(tmp_path):
    # `sandboxer fork --snapshot NAME` was refused ("not a snapshot id"), though `snapshots` lists
    # the names and `checkpoint --name` gives them.
    with WsBox(tmp_path, ["python3", "-c", NAMING_AGENT], extra=["--set", "resources.grace=1s"]) as box:
        wait_for_output(box, "main", "agent checkpoint True")
        r = cli(box, "checkpoint", box.url, "--name", "base")
        assert r.returncode == 0, r.stderr
        base = r.stdout.strip().splitlines()[-1]
        mine = next(json.loads(line) for line in cli(box, "snapshots", box.url, "--json").stdout.splitlines()
                    if json.loads(line)["name"] == "agents")
        # The table says who asked for each: the operator's, the agent's (a name it chose).
        rows = {line.split()[0]: line.split()[7:] for line in cli(box, "snapshots", box.url).stdout.splitlines()[1:]}
        assert rows == {base: ["operator", "base"], mine["id"]: ["agent:main", "agents"]}, rows
        f = cli(box, "fork", box.url, "--snapshot", "base", "-n", "1")
        assert f.returncode == 0, f.stderr
        assert f.stderr == f'sandboxer fork: snapshot "base" is {base}\n', f.stderr
        copy = f.stdout.split()[0]
        wait_for_output(box, copy, "\n")
        # One the agent made is said to be its.
        e = cli(box, "export", box.url, "agents", str(tmp_path / "agents.tar.zst"))
        assert e.returncode == 0, e.stderr
        assert e.stderr.startswith(f'sandboxer export: snapshot "agents" is {mine["id"]}, made by the agent of branch '
                                   'main\n'), e.stderr
        # A name no snapshot has, and one two have, are refused naming why; nothing is restored.
        nope = cli(box, "restore", box.url, "nope")
        assert nope.returncode == 1 and "(not_found)" in nope.stderr and '"nope" is neither a snapshot id' in nope.stderr
        again = cli(box, "checkpoint", box.url, "--name", "base")
        assert again.returncode == 0, again.stderr
        second = again.stdout.strip().splitlines()[-1]
        twice = cli(box, "fork", box.url, "--snapshot", "base", "-n", "1")
        assert twice.returncode == 1 and "(ambiguous)" in twice.stderr, twice.stderr
        assert base in twice.stderr and second in twice.stderr and '"base" names 2 snapshots' in twice.stderr
        assert [e["branch"] for e in box.read_events() if e["type"] == "restore.done"] == [copy]


@contextlib.contextmanager
def agent_and_idle_box(tmp_path, source):
    """Box A running `python3 -c source` and box B idle (no agent), side by side."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with WsBox(tmp_path / "a", ["python3", "-c", source], extra=["--set", "resources.grace=1s"]) as a, \
            WsBox(tmp_path / "b", [], extra=["--idle", "--set", "resources.grace=1s"]) as b:
        yield a, b


def test_export_then_import_into_another_box_restores_the_live_agent(tmp_path):
    archive = tmp_path / "moved.tar.zst"
    with agent_and_idle_box(tmp_path, COUNTER) as (a, b):
        time.sleep(1.0)
        r = cli(a, "checkpoint", a.url)
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip().splitlines()[-1]
        at_checkpoint = max(outputs(a, "main"))
        e = cli(a, "export", a.url, snap, str(archive))
        assert e.returncode == 0, e.stderr
        assert archive.stat().st_size > 0 and not (tmp_path / "moved.tar.zst.part").exists()
        i = cli(b, "import", b.url, str(archive))
        assert i.returncode == 0, i.stderr
        # The id names the content: the same id in the other box.
        assert i.stdout.strip().splitlines()[-1] == snap
        assert snap in cli(b, "snapshots", b.url).stdout
        imported = b.read_events()
        assert any(ev["type"] == "snapshot.imported" and ev["snapshot"] == snap for ev in imported)
        again = cli(b, "import", b.url, str(archive), "--json")
        assert again.returncode == 0 and json.loads(again.stdout.splitlines()[0])["existing"] is True
        f = cli(b, "fork", b.url, "--snapshot", snap, "-n", "1")
        assert f.returncode == 0, f.stderr
        branch = f.stdout.split()[0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(list(outputs(b, branch))) < 3:
            time.sleep(0.1)
        seen = list(outputs(b, branch))
        # Box B continues A's agent from memory: it counts on from the checkpoint.
        assert seen and 1 < seen[0] <= at_checkpoint + 2, (seen[:3], at_checkpoint)
        assert a.alive() and b.alive()


# COUNTER that ends with status 7 once /workspace/stop exists.
STOPPABLE = ("import os, time\n"
             "n = 0\n"
             "while not os.path.exists('/workspace/stop'):\n"
             "    n += 1\n"
             "    print(n, flush=True)\n"
             "    time.sleep(0.1)\n"
             "raise SystemExit(7)\n")


def test_an_idle_box_becomes_the_copy_it_is_asked_to_restore_with_an_index(tmp_path):
    archive = tmp_path / "moved.tar.zst"
    with agent_and_idle_box(tmp_path, STOPPABLE) as (a, b):
        time.sleep(1.0)
        snap = cli(a, "checkpoint", a.url).stdout.strip().splitlines()[-1]
        at_checkpoint = max(outputs(a, "main"))
        assert cli(a, "export", a.url, snap, str(archive)).returncode == 0
        assert cli(b, "import", b.url, str(archive)).returncode == 0
        # A box with an agent of its own is refused: --index is for idle boxes only.
        r = cli(a, "restore", a.url, snap, "--index", "1")
        assert r.returncode != 0 and "runs an agent of its own" in r.stderr, r.stderr
        # A restore that fails leaves the idle box idle.
        r = cli(b, "restore", b.url, "s-0000000000000000", "--index", "2")
        assert r.returncode != 0 and b.alive()
        before = max(e["seq"] for e in b.read_events())
        r = cli(b, "restore", b.url, snap, "--index", "2")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[0] == "main"
        # Now it runs an agent: a second one is refused.
        again = cli(b, "restore", b.url, snap, "--index", "3")
        assert again.returncode != 0 and "runs an agent of its own" in again.stderr, again.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(outputs(b, "main")) < 3:
            time.sleep(0.1)
        seen = outputs(b, "main")
        # The box's own agent continues A's from memory, as copy 2, its journal after A's.
        assert seen and 1 < seen[0] <= at_checkpoint + 2, (seen[:3], at_checkpoint)
        done = next(e for e in b.read_events() if e["type"] == "restore.done")
        assert (done["branch"], done["index"], done["mode"]) == ("main", 2, "live"), done
        last_seq = json.loads((b.state / "snapshots" / f"{snap}.json").read_text())["last_seq"]
        assert last_seq > before and done["seq"] > last_seq, (before, last_seq, done["seq"])
        # The box ends with its agent, with its status, as a box started with --restore does.
        (b.workspace / "stop").write_text("")
        assert b.proc.wait(timeout=30) == 7
        assert a.alive()


def test_a_truncated_or_corrupted_import_is_refused_and_leaves_nothing(tmp_path):
    good = tmp_path / "good.tar.zst"
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        time.sleep(0.5)
        snap = cli(box, "checkpoint", box.url).stdout.strip().splitlines()[-1]
        assert cli(box, "export", box.url, snap, str(good)).returncode == 0
        data = good.read_bytes()
        truncated = tmp_path / "truncated.tar.zst"
        truncated.write_bytes(data[: len(data) // 2])
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        corrupted = tmp_path / "corrupted.tar.zst"
        corrupted.write_bytes(bytes(flipped))
        before = sorted(p.name for p in (box.state / "snapshots").iterdir())
        for bad in (truncated, corrupted):
            r = cli(box, "import", box.url, str(bad))
            assert r.returncode != 0 and "sandboxer import:" in r.stderr and "refused" in r.stderr, r.stderr
        # Nothing half-imported: the store holds what it held, no temporary files.
        assert sorted(p.name for p in (box.state / "snapshots").iterdir()) == before
        # Control: the intact archive is accepted by the same command.
        ok = cli(box, "import", box.url, str(good))
        assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1] == snap
        missing = cli(box, "export", box.url, "s-0000000000000000", str(tmp_path / "none.tar.zst"))
        assert missing.returncode != 0 and "no snapshot" in missing.stderr
        assert not (tmp_path / "none.tar.zst").exists() and not (tmp_path / "none.tar.zst.part").exists()
        assert box.alive()


IDENTITY = ("import time, socket\n"
            "while True:\n"
            "    print(open('/etc/machine-id').read().strip(), socket.gethostname(), flush=True)\n"
            "    time.sleep(0.1)\n")


def identities(box, branch):
    text = text_of(box, branch)
    return [tuple(row.split()) for row in text[:text.rfind("\n") + 1].splitlines() if len(row.split()) == 2]


def test_each_copy_is_another_system_with_its_own_machine_id_and_hostname(tmp_path):
    host_id = pathlib.Path("/etc/machine-id").read_text().strip()
    with WsBox(tmp_path, ["python3", "-c", IDENTITY], extra=["--set", "resources.grace=1s"]) as box:
        branches = checkpoint_and_fork(box, 2)
        time.sleep(1.0)
        main_id, main_host = list(identities(box, "main"))[-1]
        # The box's own agent already has an id of its own, not the host's.
        assert main_id != host_id and len(main_id) == 32
        assert main_id == (box.state / "branches" / "main" / "machine-id").read_text().strip()
        seen = {}
        for b in branches:
            ids = list(identities(box, b))
            assert ids, f"copy {b} printed nothing"
            seen[b] = ids[-1]
            assert seen[b][0] == (box.state / "branches" / b / "machine-id").read_text().strip()
        assert len({main_id} | {i for i, _ in seen.values()}) == 3, (main_id, seen)
        assert len({main_host} | {h for _, h in seen.values()}) == 3, (main_host, seen)


def test_a_checkpoint_taken_while_a_client_streams_is_in_the_stream_which_goes_on(tmp_path):
    with WsBox(tmp_path, ["python3", "-c", COUNTER], extra=["--set", "resources.grace=1s"]) as box:
        async def go():
            async with ws_connect(box) as watcher, ws_connect(box) as control:
                w = Session(watcher)
                assert (await w.request("subscribe", since=0))["ok"]
                await w.wait_event(lambda e: e["type"] == "proc.output")
                c = Session(control)
                r = await c.request("checkpoint", timeout=120, name="streamed")
                assert r["ok"], r
                created = await w.wait_event(lambda e: e["type"] == "checkpoint.created")
                # The agent goes on, and so does the stream: output after the checkpoint arrives.
                after = await w.wait_event(lambda e: e["type"] == "proc.output" and e["seq"] > created["seq"])
                return r["snapshot"], created, after, [e["seq"] for e in w.events]
        snap, created, after, seqs = run(go(), 120)
        assert created["snapshot"] == snap and created["name"] == "streamed"
        assert after["seq"] > created["seq"]
        # One unbroken sequence: nothing lost or repeated around the freeze.
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        assert box.alive()


# Counts in memory; once it is a copy it allocates 200 MB, page by page. A live copy learns it
# from branch.json (its environment is the original's); a cold one, without namespaces, from
# SANDBOXER_BRANCH.
HOG_IN_COPIES = ("import json, os, time\n"
                 "def branch():\n"
                 "    try:\n"
                 "        return json.load(open('/run/sandboxer/branch.json'))['branch']\n"
                 "    except OSError:\n"
                 "        return os.environ['SANDBOXER_BRANCH']\n"
                 "n = 0\n"
                 "while True:\n"
                 "    n += 1\n"
                 "    print(n, flush=True)\n"
                 "    if branch() != 'main':\n"
                 "        hog = b'x' * (200 << 20)\n"
                 "    time.sleep(0.1)\n")


# Holds /run/sandboxer/branch.json open (read to its end) across the checkpoint, and prints
# which branch the held descriptor and a new open each name.
HOLDS_BRANCH_JSON = ("import json, time\n"
                     "held = open('/run/sandboxer/branch.json')\n"
                     "held.read()\n"
                     "while True:\n"
                     "    held.seek(0)\n"
                     "    now = json.load(open('/run/sandboxer/branch.json'))['branch']\n"
                     "    print(json.load(held)['branch'], now, flush=True)\n"
                     "    time.sleep(0.1)\n")


def test_a_live_copy_of_an_agent_holding_its_branch_json_open_keeps_the_file_it_held(tmp_path):
    # criu checks a file a restored descriptor names against its size at the dump; the copy's own
    # branch.json (another name, another size) is written only once its tree is restored. So the
    # restore succeeds, the held descriptor reads the parent's identity (as fork(2)'s child would),
    # and a new open reads the copy's.
    with WsBox(tmp_path, ["python3", "-c", HOLDS_BRANCH_JSON], extra=["--set", "resources.grace=1s"]) as box:
        branches = checkpoint_and_fork(box, 2)
        for b in branches:
            wait_for_output(box, b, f"main {b}\n")
        assert "main main\n" in text_of(box, "main")


def exits(box):
    return {e["branch"]: e for e in box.read_events() if e["type"] == "proc.exited"}


@pytest.mark.parametrize("ceiling,namespaces", [("64M", "true"), ("64M", "false"), ("0", "true")],
                         ids=["live-copies", "cold-copies", "control-no-ceiling"])
def test_each_copy_has_its_own_cgroup_with_the_original_ceilings(tmp_path, ceiling, namespaces):
    with WsBox(tmp_path, ["python3", "-c", HOG_IN_COPIES],
               extra=["--set", "resources.grace=1s", "--set", f"resources.memory={ceiling}",
                      "--set", f"isolation.namespaces={namespaces}"]) as box:
        branches = checkpoint_and_fork(box, 2)
        # The copies under a ceiling end within a second or two of their start; the control's, which
        # should not end, are given 4 s (it waited the whole 15 s).
        deadline = time.monotonic() + (4 if ceiling == "0" else 15)
        while time.monotonic() < deadline and not all(b in exits(box) for b in branches):
            time.sleep(0.1)
        time.sleep(0.5)
        ended = exits(box)
        if ceiling == "0":
            # Control: without a ceiling the copies hold their 200 MB and keep counting.
            assert not any(b in ended for b in branches), ended
        else:
            for b in branches:
                assert b in ended and ended[b]["reason"] == "oom", (b, ended.get(b))
            hits = [e for e in box.read_events() if e["type"] == "limit.hit" and e["limit"] == "memory"]
            assert {e["branch"] for e in hits} >= set(branches), hits
        # The original, under the same ceiling in a group of its own, goes on.
        assert "main" not in ended
        before = max(outputs(box, "main"))
        time.sleep(0.5)
        assert max(outputs(box, "main")) > before


# Says, each tick, whether it can read a marker in ~/.ssh (a credential path the supervisor masks)
# and a control file beside it (not masked).
SNOOP = ("import os, time\n"
         "home = os.environ['SNOOP_HOME']\n"
         "def has(path):\n"
         "    try:\n"
         "        return 'MARKER' in open(path).read()\n"
         "    except OSError:\n"
         "        return False\n"
         "while True:\n"
         "    print('ssh', has(home + '/.ssh/id_test'), 'notes', has(home + '/notes.txt'), flush=True)\n"
         "    time.sleep(0.1)\n")


@pytest.mark.parametrize("live,home_in_tmp", [(True, False), (True, True), (False, True)],
                         ids=["live-copies", "live-copies-home-under-tmp", "cold-copies"])
def test_copies_keep_the_credential_paths_masked(tmp_path, live, home_in_tmp):
    # A home under /tmp makes the masks mount points in the copy's /tmp overlay, which criu must
    # find to restore them; elsewhere (/var/tmp) they are on the host's own directories.
    home = tmp_path / "home" if home_in_tmp else pathlib.Path(tempfile.mkdtemp(dir="/var/tmp", prefix="sbx-home-"))
    try:
        _copies_keep_the_credential_paths_masked(tmp_path, live, home)
    finally:
        if not home_in_tmp:
            shutil.rmtree(home, ignore_errors=True)


def _copies_keep_the_credential_paths_masked(tmp_path, live, home):
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_test").write_text("MARKER\n")
    (home / "notes.txt").write_text("MARKER\n")
    environ = dict(os.environ, HOME=str(home), SNOOP_HOME=str(home))
    if not live:  # no criu on PATH: a files-only checkpoint, and copies restart cold
        environ["PATH"] = ":".join(d for d in environ["PATH"].split(":")
                                   if not os.path.exists(os.path.join(d, "criu")))
    (tmp_path / "b").mkdir()
    with WsBox(tmp_path / "b", ["python3", "-c", SNOOP], extra=["--set", "resources.grace=1s", "--env", "SNOOP_HOME"],
               env=environ) as box:
        (branch,) = checkpoint_and_fork(box, 1)
        wait_for_output(box, branch, "\n")
        for b in ("main", branch):
            seen = text_of(box, b)
            # The credential path is never readable, in the original or the copy; the control file
            # beside it is.
            assert "ssh True" not in seen and "ssh False" in seen, (b, seen[-200:])
            assert "notes True" in seen, (b, seen[-200:])
        modes = [e["mode"] for e in box.read_events() if e["type"] == "restore.done"]
        assert modes == ["live" if live else "cold"]


# Holds open a file of the host's /tmp (the lower layer of its /tmp overlay, never written by the
# agent) and one it wrote itself, and prints from both each tick.
HOLDS_TMP_FILES = ("import os, sys, time\n"
                   "host = open(sys.argv[1])\n"
                   "own = open('/tmp/own.txt', 'w+')\n"
                   "own.write('OWN\\n'); own.flush()\n"
                   "while True:\n"
                   "    print(os.pread(host.fileno(), 64, 0).decode().strip(), os.pread(own.fileno(), 64, 0).decode().strip(),\n"
                   "          flush=True)\n"
                   "    time.sleep(0.1)\n")


@pytest.mark.skipif(shutil.which("criu") is None, reason="needs criu")
def test_a_live_copy_keeps_its_open_files_of_the_hosts_tmp(tmp_path):
    # A live copy's /tmp is an overlay on the host's /tmp, as its original's: a file the agent had
    # open there is there to reopen. A /tmp of the copy's own (what a live copy had before) made
    # criu's restore fail with "Can't open file ... on restore".
    shared = tmp_path / "shared.txt"
    shared.write_text("HOST\n")
    (tmp_path / "b").mkdir()
    with WsBox(tmp_path / "b", ["python3", "-c", HOLDS_TMP_FILES, str(shared)],
               extra=["--set", "resources.grace=1s"]) as box:
        (branch,) = checkpoint_and_fork(box, 1)
        wait_for_output(box, branch, "HOST OWN\n")
        assert [e["mode"] for e in box.read_events() if e["type"] == "restore.done"] == ["live"]
        # A checkpoint of the copy holds what it wrote to /tmp (its overlay's upper layer): a copy
        # of it reopens that file too.
        (again,) = checkpoint_and_fork(box, 1, branch)
        wait_for_output(box, again, "HOST OWN\n")


# Holds open a file it wrote in /tmp, and prints from it each tick.
HOLDS_OWN_TMP_FILE = ("import os, time\n"
                      "own = open('/tmp/own.txt', 'w+')\n"
                      "own.write('OWN\\n'); own.flush()\n"
                      "while True:\n"
                      "    print('mine', os.pread(own.fileno(), 64, 0).decode().strip(), flush=True)\n"
                      "    time.sleep(0.1)\n")


@pytest.mark.skipif(shutil.which("criu") is None, reason="needs criu")
def test_a_live_copy_has_a_tmp_of_its_own_where_no_overlay_can_be_had(tmp_path):
    # A state dir on overlayfs (a container's root): the branch's /tmp is its own tmp/, bound,
    # which the mount table also shows as "overlay"; the checkpoint takes that directory (not the
    # overlay's empty upper layer), and the copy, whose overlay is refused too, gets the files in
    # a /tmp of its own (a bind of its tmp-upper/) and reopens the one its agent had open; a
    # checkpoint of the copy takes that directory. Then the same for a copy of it.
    with overlayfs_dir(tmp_path) as mnt:
        (mnt / "b").mkdir()
        with WsBox(mnt / "b", ["python3", "-c", HOLDS_OWN_TMP_FILE], extra=["--set", "resources.grace=1s"]) as box:
            branch = "main"
            for _ in range(2):
                (branch,) = checkpoint_and_fork(box, 1, None if branch == "main" else branch)
                wait_for_output(box, branch, "mine OWN\n")
                # Its /tmp is a bind of its tmp-upper/ (overlay refused there too), not tmp/ itself.
                assert (box.state / "branches" / branch / "tmp-upper" / "own.txt").read_text() == "OWN\n"
                assert not (box.state / "branches" / branch / "tmp" / "own.txt").exists()
            assert [e["mode"] for e in box.read_events() if e["type"] == "restore.done"] == ["live", "live"]


# Keeps a file in /tmp across restarts: the first run writes it, a run that finds it says so.
KEEPS_TMP_FILE = ("import os, time\n"
                  "p = '/tmp/own.txt'\n"
                  "if os.path.exists(p):\n"
                  "    print('found', open(p).read().strip(), flush=True)\n"
                  "else:\n"
                  "    open(p, 'w').write('OWN\\n')\n"
                  "    print('made', flush=True)\n"
                  "while True:\n"
                  "    time.sleep(0.1)\n")


def test_a_cold_copy_keeps_its_tmp_where_no_overlay_can_be_had(tmp_path):
    # The cold half of the test above: no criu, so a files-only checkpoint and copies that start
    # their agent again. On a state dir on overlayfs the branch's /tmp is its tmp/, bound; the
    # checkpoint takes that directory, and the copy's /tmp (a bind again, as overlay is refused)
    # holds the file its agent wrote before the checkpoint. Then the same for a copy of the copy.
    environ = dict(os.environ)
    environ["PATH"] = ":".join(d for d in environ["PATH"].split(":") if not os.path.exists(os.path.join(d, "criu")))
    with overlayfs_dir(tmp_path) as mnt:
        (mnt / "b").mkdir()
        with WsBox(mnt / "b", ["python3", "-c", KEEPS_TMP_FILE], extra=["--set", "resources.grace=1s"],
                   env=environ) as box:
            wait_for_output(box, "main", "made\n")
            branch = "main"
            for _ in range(2):
                (branch,) = checkpoint_and_fork(box, 1, None if branch == "main" else branch)
                wait_for_output(box, branch, "found OWN\n")
                assert "made" not in text_of(box, branch)
            assert [e["mode"] for e in box.read_events() if e["type"] == "restore.done"] == ["cold", "cold"]



def kdat_caches(pid):
    """criu's kerndat cache files in the tmpfs the supervisor holds detached (KdatCache): reached
    through its fd's /proc link, as no path names it."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.path.isfile(f"/proc/{pid}/fd/{fd}/criu.kdat"):
                found.append(fd)
    return found


@pytest.mark.skipif(shutil.which("criu") is None, reason="needs criu")
@pytest.mark.parametrize("warm", ["200", "off"], ids=["warmed-ahead", "control-off"])
def test_criu_kerndat_cache_is_filled_before_the_first_checkpoint(tmp_path, warm):
    # The box fills criu's kerndat cache shortly after it starts, so its first dump (inside the
    # agent's pause) loads it instead of probing the kernel. Control: with the warm-up off, no
    # cache until a criu has run; after the checkpoint's dump, the cache is there either way.
    # Where the checkpoint had to run the probe itself, it did so before it stopped the agent,
    # and says how long it waited (timings_ms.probe_wait, no part of pause_ms); the next does not.
    with WsBox(tmp_path, ["sleep", "60"], env=dict(os.environ, SANDBOXER_KDAT_WARM_MS=warm)) as box:
        deadline = time.monotonic() + (10 if warm != "off" else 2)
        while time.monotonic() < deadline and not kdat_caches(box.proc.pid):
            time.sleep(0.1)
        assert bool(kdat_caches(box.proc.pid)) == (warm != "off")
        assert cli(box, "checkpoint", box.url).returncode == 0
        assert kdat_caches(box.proc.pid)
        assert cli(box, "checkpoint", box.url).returncode == 0
        deadline, created = time.monotonic() + 20, []
        while time.monotonic() < deadline and len(created) < 2:
            created = [e["timings_ms"] for e in read_journal(box.state) if e["type"] == "checkpoint.created"]
            time.sleep(0.1)
        first, second = created[:2]
        assert ("probe_wait" in first) == (warm == "off"), first
        assert "probe_wait" not in second, second


# criu 4.2's kernel probe forks without checking the fork (vdso_mmap_compat in criu/vdso.c); when
# that fork fails, as at a pids ceiling the agent has reached in a container, it calls
# kill(-1, SIGKILL). This criu stands for that failure: without a kerndat cache on its /run it
# signals all it can, then goes on as the real criu. It never does so in the test's own pid
# namespace (host_ns), whatever happens.
KILLING_CRIU = """#!/bin/sh
if [ "$1" != "--version" ] && [ ! -s /run/criu.kdat ] && [ "$(readlink /proc/self/ns/pid)" != "{host_ns}" ]; then
  echo "$$" >> {ran}
  kill -KILL -1
fi
exec {criu} "$@"
"""


def supervisor_of(box):
    """The supervisor's pid in our namespace: unshare's one child (WsBox with as_pid1)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = pathlib.Path(f"/proc/{box.proc.pid}/task/{box.proc.pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.02)
    raise TimeoutError("unshare has no child")


@pytest.mark.skipif(shutil.which("criu") is None or shutil.which("nsenter") is None, reason="needs criu, nsenter")
@pytest.mark.parametrize("first", ["warm-up", "checkpoint", "control-in-the-box-pid-ns"])
def test_a_criu_probe_that_kills_all_it_can_signal_reaches_no_process_of_the_box(tmp_path, first):
    # The box probes with a criu that is PID 1 of a pid namespace of its own: ahead (the warm-up),
    # or just before the first criu that touches a tree (a checkpoint with the warm-up off). That
    # criu kills nothing of the box, and every later criu loads the cache. The supervisor is PID
    # 1 of a pid namespace, as in a container. Control: the same criu run in the box's pid
    # namespace, where the box ran its criu before, kills the agent.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ran = tmp_path / "ran"
    (bindir / "criu").write_text(KILLING_CRIU.format(host_ns=os.readlink("/proc/self/ns/pid"), ran=ran,
                                                     criu=shutil.which("criu")))
    (bindir / "criu").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}",
               SANDBOXER_KDAT_WARM_MS="50" if first == "warm-up" else "off")
    with WsBox(tmp_path, ["sleep", "60"], env=env, as_pid1=True) as box:
        box.wait_event(lambda e: e["type"] == "proc.started")
        if first == "control-in-the-box-pid-ns":
            subprocess.run(["nsenter", "--target", str(supervisor_of(box)), "--pid", "--", str(bindir / "criu"),
                            "check", "--feature", "mnt_id"], env=env, capture_output=True, timeout=60)
            ex = box.wait_event(lambda e: e["type"] == "proc.exited", timeout=10)
            assert ex.get("signal") == "KILL", ex
            return
        if first == "warm-up":
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not kdat_caches(supervisor_of(box)):
                time.sleep(0.05)
            assert kdat_caches(supervisor_of(box)), "the warm-up filled no cache"
        r = cli(box, "checkpoint", box.url)
        assert r.returncode == 0, r.stderr
        # One probe, by a criu that was PID 1 of its namespace; the dump loaded the cache.
        assert ran.read_text().split() == ["1"]
        time.sleep(0.3)
        assert box.alive() and not [e for e in box.read_events() if e["type"] == "proc.exited"], box.read_events()


# Waits for the test's go, then holds all pids, or (with the argument "one") all but one.
HOLD_PIDS = """
import os, sys, time
while not os.path.exists("/workspace/go"):
    time.sleep(0.05)
""" + FORK_UNTIL_REFUSED + r'''
if sys.argv[1:] == ["one"]:
    os.kill(kids[-1], 9)
    os.waitpid(kids.pop(), 0)  # a zombie still holds its pid
print("holding", flush=True)
time.sleep(600)
'''


def tree_of(pid):
    """`pid` and all its descendants, through /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for t in pathlib.Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (t / "children").read_text().split()]
    return out


@pytest.mark.skipif(shutil.which("criu") is None or not os.access(PIDS_V1 / "cgroup.procs", os.W_OK),
                    reason="needs criu and a cgroup v1 pids hierarchy")
@pytest.mark.parametrize("free,why", [("one", "wrote no cache"), ("none", "could not start")],
                         ids=["all-pids-but-one", "all-pids"])
def test_no_criu_probes_beside_an_agent_that_holds_the_pids(tmp_path, free, why):
    # As in a container: no cgroup of the box's own, one pids limit for the box, and an agent that
    # holds all pids of it, or all but one, while the kerndat cache is empty (the warm-up off).
    # With one free, the probe, in its own pid namespace, gets it and its forks are refused: it
    # writes no cache. With none, the probe cannot start. Either way the checkpoint is refused
    # saying why, rather than a criu probing beside the agent at the same ceiling. The agent runs
    # on; once the pids are free, a checkpoint works.
    env = dict(os.environ, SANDBOXER_CGROUP="none", SANDBOXER_KDAT_WARM_MS="off")
    with pids_group() as cg, WsBox(tmp_path, ["python3", "-c", HOLD_PIDS, free], env=env, as_pid1=True) as box:
        box.wait_event(lambda e: e["type"] == "proc.started")
        for pid in tree_of(box.proc.pid):
            (cg / "cgroup.procs").write_text(str(pid))
        (cg / "pids.max").write_text(str(int((cg / "pids.current").read_text()) + 30))
        (box.workspace / "go").write_text("")
        box.wait_event(lambda e: e["type"] == "proc.output" and "holding" in e["data"], timeout=30)
        r = cli(box, "checkpoint", box.url)
        assert r.returncode != 0 and "not started beside the agent" in r.stderr and why in r.stderr, r.stderr
        assert box.alive() and not [e for e in box.read_events() if e["type"] == "proc.exited"]
        (cg / "pids.max").write_text("max")
        r = cli(box, "checkpoint", box.url)
        assert r.returncode == 0, r.stderr
        assert not [e for e in box.read_events() if e["type"] == "proc.exited"]
