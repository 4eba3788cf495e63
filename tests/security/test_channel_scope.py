"""The agent channel's reach and the per-box bounds (issue #13 item 9).

The agent (root in its box, hostile) holds the agent channel and no token. Its channel reaches the
snapshots its own branch took (and restores the one its branch came from); the operator, holding
the token, reaches all. A box runs at most `resources.copies` copies and keeps at most
`resources.snapshots` snapshots; past either, the request is refused with code `limit` and a
`limit.hit` event. A copy gets exactly its parent's policy, a cold one included.

Most run without criu on PATH (checkpoints of the files, cold copies): what is checked is the
supervisor's decision, which is the same for live copies, and cold copies are the ones that had
their own policy path."""
import json
import os
import pathlib
import subprocess

from sbxtest import CLI, ROOT, Session, WsBox, box, of_type, run, ws_connect

HERE = pathlib.Path(__file__).resolve().parent

ATTACKS = HERE / "agents" / "channel.py"
SDK = ROOT / "sdk" / "python" / "sandboxer"


def no_criu_env(**extra):
    path = ":".join(d for d in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(d, "criu")))
    return dict(os.environ, PATH=path, SBX_AGENT_SDK=str(SDK), **extra)


def attack(*args):
    # The host's python3: the agent may run as nobody, who cannot reach a venv under /root.
    return ["/usr/bin/python3", str(ATTACKS), *[str(a) for a in args]]


def messages(events, branch=None):
    return [e["message"] for e in events
            if e["type"] == "proc.message" and (branch is None or e["branch"] == branch)]


def run_box(state_dir, argv, *sets, profile=None):
    r, ev = box(state_dir, argv, *sets, profile=profile, env=no_criu_env(), timeout=90)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return ev


def wait_message(b, pred, timeout=30):
    return b.wait_event(lambda e: e["type"] == "proc.message" and pred(e["message"]), timeout)["message"]


def test_the_agent_cannot_restore_or_delete_the_operators_snapshot(tmp_path):
    with WsBox(tmp_path, attack("reach", "/workspace/snap"), env=no_criu_env()) as b:
        async def operator_checkpoint():
            async with ws_connect(b) as ws:
                return await Session(ws).request("checkpoint", branch="main", timeout=60)

        snap = run(operator_checkpoint())
        assert snap["ok"] is True, snap
        # Renamed into place: the agent reads the file once it exists (a write_text in place was
        # read empty now and then, before its content).
        (b.workspace / "snap.tmp").write_text(snap["snapshot"])
        (b.workspace / "snap.tmp").rename(b.workspace / "snap")
        out = wait_message(b, lambda m: "restore" in m)
        assert out["snapshot"] == snap["snapshot"]
        # The operator's snapshot is not even listed for the agent.
        assert snap["snapshot"] not in out["listed"]
        for what in ("restore", "delete"):
            assert out[what]["ok"] is False and out[what]["code"] == "forbidden", out[what]
            assert "the operator's" in out[what]["message"] and "only the snapshots it took itself" in out[what]["message"]
        # Its own snapshot is within its reach (the same calls work on it).
        assert len(out["own_listed"]) == 1 and out["own_delete"]["ok"] is True, out

        # Control: the operator (token holder) restores and deletes the same snapshot.
        async def operator_reach():
            async with ws_connect(b) as ws:
                s = Session(ws)
                return (await s.request("restore", snapshot=snap["snapshot"], timeout=60),
                        await s.request("snapshot.delete", snapshot=snap["snapshot"], timeout=60))

        restored, deleted = run(operator_reach())
        (b.workspace / "snap.end").touch()
        assert restored["ok"] is True and deleted["ok"] is True, (restored, deleted)
    assert not list((b.state / "snapshots").glob(snap["snapshot"] + "*"))


def test_a_fork_past_resources_copies_is_refused_with_limit_hit(tmp_path):
    # Three copies asked for, two allowed; the control: two work.
    ev = run_box(tmp_path / "s", attack("fork", 3, 2), "resources.copies=2")
    refused, allowed = sorted(messages(ev, "main"), key=lambda m: -m["n"])
    assert refused["ok"] is False and refused["code"] == "limit", refused
    assert "resources.copies: at most 2 copies" in refused["message"]
    hit = of_type(ev, "limit.hit")
    assert [(h["limit"], h["value"], h["ceiling"], h["branch"]) for h in hit] == [("copies", 3, 2, "main")]
    assert allowed["ok"] is True and len(allowed["reply"]["copies"]) == 2, allowed
    # The refused fork took no snapshot: the one checkpoint is the control's.
    assert len(of_type(ev, "checkpoint.created")) == 1
    assert len(of_type(ev, "restore.done")) == 2


def test_snapshots_past_resources_snapshots_are_refused_with_limit_hit(tmp_path):
    ev = run_box(tmp_path / "s", attack("checkpoints", 3), "resources.snapshots=2")
    tries = sorted((m for m in messages(ev) if "i" in m), key=lambda m: m["i"])
    assert [t["ok"] for t in tries] == [True, True, False]
    assert tries[2]["code"] == "limit" and "resources.snapshots: this box keeps at most 2" in tries[2]["message"]
    hit = of_type(ev, "limit.hit")
    assert [(h["limit"], h["value"], h["ceiling"]) for h in hit] == [("snapshots", 3, 2)]
    # Control: once one is deleted, the next checkpoint is taken.
    again = next(m for m in messages(ev) if m.get("after_delete"))
    assert again["ok"] is True, again
    assert len(list((tmp_path / "s" / "snapshots").glob("s-*.json"))) == 2


def test_a_cold_copy_of_an_untrusted_branch_gets_its_parents_policy(tmp_path):
    ev = run_box(tmp_path / "s", attack("copy_policy"), profile="untrusted")
    orig = next(m for m in messages(ev, "main") if m.get("original"))
    fork = next(m for m in messages(ev, "main") if "fork" in m)["fork"]
    assert fork["ok"] is True and fork["reply"]["copies"][0]["mode"] == "cold", fork
    copy = next(m for m in messages(ev) if m.get("copy"))
    # The original's file is there (its content is copy_tree's business: copy_file_range from the
    # tmpfs does not copy across filesystems on this kernel, a bug reported to its owner).
    assert copy["branch"] == "f1" and copy["file"] is not None
    # The disk ceiling: a 256M tmpfs, as the original's.
    assert orig["workspace_bytes"] == copy["workspace_bytes"] == 256 << 20
    # The agent's user owns its workspace, as in the original.
    assert orig["uid"] == copy["uid"] == 65534
    assert orig["workspace_uid"] == copy["workspace_uid"] == 65534
    # Landlock: the same refusal of a write outside its rw paths.
    assert orig["dev_full"] == copy["dev_full"] == "refused: Permission denied"


def test_control_without_landlock_the_same_probe_writes(tmp_path):
    # The control of the Landlock probe above: the same profile without Landlock.
    ev = run_box(tmp_path / "s", attack("copy_policy"), "isolation.landlock=null", profile="untrusted")
    copy = next(m for m in messages(ev) if m.get("copy"))
    assert copy["dev_full"] == "writable"


def test_an_import_past_resources_snapshots_is_refused(tmp_path):
    from sbxtest import CLI
    import subprocess

    def cli(b, *args):
        return subprocess.run([str(CLI), *args, "--token-file", str(b.token_file)], capture_output=True, text=True,
                              timeout=60, env=no_criu_env())

    archive = tmp_path / "moved.tar.zst"
    for d in ("a", "full", "room"):
        (tmp_path / d).mkdir()
    with WsBox(tmp_path / "a", ["sleep", "30"], env=no_criu_env()) as a, \
            WsBox(tmp_path / "full", [], extra=["--idle", "--set", "resources.snapshots=0"], env=no_criu_env()) as full, \
            WsBox(tmp_path / "room", [], extra=["--idle", "--set", "resources.snapshots=1"], env=no_criu_env()) as room:
        r = cli(a, "checkpoint", a.url)
        assert r.returncode == 0, r.stderr
        snap = r.stdout.strip().splitlines()[-1]
        assert cli(a, "export", a.url, snap, str(archive)).returncode == 0
        refused = cli(full, "import", full.url, str(archive))
        assert refused.returncode != 0 and "resources.snapshots: this box keeps at most 0" in refused.stderr, refused
        hit = full.read_events()
        assert [(e["limit"], e["value"], e["ceiling"]) for e in hit if e["type"] == "limit.hit"] == [("snapshots", 1, 0)]
        assert not list((full.state / "snapshots").glob("s-*")) and not list((full.state / "snapshots").glob(".import-*"))
        # Control: a box with room for it takes it.
        ok = cli(room, "import", room.url, str(archive))
        assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1] == snap, ok


def test_a_snapshot_name_the_agent_chose_cannot_act_on_the_operators_terminal(tmp_path):
    # The agent names its checkpoint with a title-setting OSC, a colour, a C1 CSI and a newline,
    # and sends an event whose type holds them: `sandboxer snapshots` and `sandboxer log` printed
    # them raw into the operator's terminal.
    evil = "x\x1b]0;pwned\x07\x1b[31mred\u009b2J\nSNAPSHOT forged"
    with WsBox(tmp_path, attack("name", evil), env=no_criu_env()) as b:
        named = wait_message(b, lambda m: "named" in m)["named"]
        assert named["ok"] is True, named
        cli = lambda *a: subprocess.run([str(CLI), *a, "--token-file", str(b.token_file)], capture_output=True,
                                        timeout=60)
        listed, as_json = cli("snapshots", b.url), cli("snapshots", b.url, "--json")
        (b.workspace / "done").touch()
    log = subprocess.run([str(CLI), "log", str(b.state)], capture_output=True, timeout=60)
    log_json = subprocess.run([str(CLI), "log", str(b.state), "--json"], capture_output=True, timeout=60)
    for r in (listed, as_json, log, log_json):
        assert r.returncode == 0, r.stderr
    # The control: the name the box keeps is the agent's, bytes and all, and the JSON forms say
    # so; JSON escapes C0 controls, and the CLI's JSON and the journal its C1 ones too (\u009b),
    # which JSON may carry raw (the journal did before 2026-12-07) and some terminals act on.
    assert [json.loads(line)["name"] for line in as_json.stdout.splitlines()] == [evil]
    journal = (b.state / "journal" / ("%020d.jsonl" % 1)).read_bytes()
    assert b"\xc2\x9b" not in journal and b"\\u009b" in journal
    for r in (as_json, log_json):
        assert b"\xc2\x9b" not in r.stdout and b"\\u009b" in r.stdout, r.stdout[-400:]
    assert any(json.loads(line).get("name") == evil for line in log_json.stdout.splitlines())
    for r in (listed, log):
        assert b"\x1b" not in r.stdout and b"\x9b" not in r.stdout and b"\x07" not in r.stdout, r.stdout
    assert b"x\\x1b]0;pwned\\x07\\x1b[31mred\\xc2\\x9b2J\\x0aSNAPSHOT forged" in listed.stdout, listed.stdout
    assert len(listed.stdout.splitlines()) == 2  # the header and the one snapshot: no forged line
    # `log` shows the agent's event type escaped as well (it printed it raw).
    assert b"agent.tx\\x1b]0;pwned\\x07" in log.stdout, log.stdout
