"""The branch's root: the host read-only, the workspace and /tmp writable and private, the
supervisor's state dir invisible, ns-init PID 1 of the agent's own pid namespace."""
import shutil
import subprocess
import time

from sbxtest import INIT, overlayfs_dir, read_journal, run_init


def sh(tmp_path, script, **kw):
    r = run_init(["--", "/bin/sh", "-c", script], tmp_path / "s", **kw)
    out = "".join(e.get("data", "") for e in read_journal(tmp_path / "s") if e["type"] == "proc.output")
    return r, out


def test_host_is_read_only_and_workspace_is_writable(tmp_path):
    r, out = sh(tmp_path, "touch /usr/sbx-probe 2>&1; echo data > /workspace/f && cat /workspace/f; pwd")
    assert "Read-only file system" in out
    assert "data\n/workspace\n" in out
    assert (tmp_path / "s/branches/main/workspace/f").read_text() == "data\n"


def test_tmp_writes_stay_private_but_host_tmp_is_readable(tmp_path):
    marker = tmp_path / "host-file"
    marker.write_text("from the host")
    r, out = sh(tmp_path, f"cat {marker}; echo private > /tmp/sbx-private-probe && cat /tmp/sbx-private-probe")
    assert "from the host" in out and "private" in out
    assert not subprocess.run(["test", "-e", "/tmp/sbx-private-probe"]).returncode == 0


def test_tmp_is_a_volatile_overlay_and_stays_one_when_the_box_starts_again(tmp_path):
    # `volatile`: the branch's end does not sync the host filesystem under the state dir (bench/pid1).
    # Such a mount leaves work/incompat/volatile in its workdir, and overlayfs refuses that workdir
    # while it is there: without its removal the second run's /tmp would silently be a plain
    # directory, not the overlay of the host's /tmp.
    script = "grep ' /tmp ' /proc/self/mountinfo; cat /tmp/sbx-kept 2>/dev/null; echo kept > /tmp/sbx-kept"
    for run in range(2):
        r = run_init(["--", "/bin/sh", "-c", script], tmp_path / "s")
        assert r.returncode == 0, r.stderr
        events = read_journal(tmp_path / "s")
        last = max(i for i, e in enumerate(events) if e["type"] == "box.started")
        out = "".join(e.get("data", "") for e in events[last:] if e["type"] == "proc.output")
        mount = out.splitlines()[0].split(" - ")
        assert mount[1].startswith("overlay overlay ") and "fsync=volatile" in mount[1], out
        assert (tmp_path / "s/branches/main/tmp-work/work/incompat/volatile").is_dir()
        # What the first run wrote to /tmp is there for the second, as before.
        assert ("kept" in out.splitlines()[1:]) == (run == 1), out


def test_tmp_is_the_branch_directory_where_no_overlay_can_be_had(tmp_path):
    # A state dir on an overlay filesystem (as in a container) cannot hold the upper directory of
    # another: /tmp is then the branch's own directory, bound nosuid,nodev, and the host's is not
    # seen. Control: the overlay mount itself refused, as the branch's start met it.
    with overlayfs_dir(tmp_path) as mnt:
        up, wk, low = (mnt / x for x in ("u", "w", "l"))
        for d in (up, wk, low):
            d.mkdir()
        refused = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={low},upperdir={up},"
                                  f"workdir={wk}", str(low)], capture_output=True, text=True)
        assert refused.returncode != 0, "an overlay's upper directory on an overlay was accepted"
        marker = tmp_path / "host-file"
        marker.write_text("host")
        state = mnt / "s"
        r = run_init(["--", "/bin/sh", "-c", f"grep ' /tmp ' /proc/self/mountinfo; echo mine > /tmp/f; "
                      f"cat {marker} 2>&1; exit 0"], state)
        assert r.returncode == 0, r.stderr
        out = "".join(e.get("data", "") for e in read_journal(state) if e["type"] == "proc.output").splitlines()
        fields = out[0].split(" - ")[0].split()
        assert fields[3] == "/s/branches/main/tmp" and {"nosuid", "nodev"} <= set(fields[5].split(",")), out
        assert "No such file" in out[1], out
        assert (state / "branches/main/tmp/f").read_text() == "mine\n"


def test_state_dir_is_masked(tmp_path):
    r, out = sh(tmp_path, f"ls -A {tmp_path / 's'} | wc -l; cat {tmp_path / 's/box.json'} 2>&1")
    assert out.splitlines()[0].strip() == "0"
    assert "No such file" in out or "Permission denied" in out


def test_the_agent_has_its_own_pid_namespace_under_ns_init(tmp_path):
    r, out = sh(tmp_path, "echo $$; cat /proc/1/cmdline | tr '\\0' ' '")
    pid, cmdline = out.splitlines()[:2]
    assert pid == "2"
    assert cmdline.strip() == "/run/sandboxer/bin/ns-init"
    started = [e for e in read_journal(tmp_path / "s") if e["type"] == "box.started"][0]
    assert started["capabilities"]["namespaces"] is True


def ns_init_of_a_sleeping_box(init, state):
    """(cmdline, shared objects mapped) of the ns-init under a box of `init` whose agent sleeps,
    read from the host (the agent may not read ns-init's maps), and the box's stderr at its end."""
    p = subprocess.Popen([str(init), "--state-dir", str(state), "--", "sleep", "30"], stderr=subprocess.PIPE)
    try:
        for _ in range(500):
            kids = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
            found = [k for k in kids if open(f"/proc/{k}/cmdline", "rb").read().startswith(b"/run/sandboxer/bin/ns-init")]
            if found:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("no ns-init under the box")
        # Its maps once it has started the agent: right after its exec only the loader is mapped.
        for _ in range(500):
            if open(f"/proc/{found[0]}/task/{found[0]}/children").read().split():
                break
            time.sleep(0.01)
        else:
            raise AssertionError("ns-init started no agent")
        cmdline = open(f"/proc/{found[0]}/cmdline", "rb").read().split(b"\0")[:-1]
        files = {line.split()[-1] for line in open(f"/proc/{found[0]}/maps") if len(line.split()) > 5}
        assert "/run/sandboxer/bin/ns-init" in files, files  # the maps were read: its own text is there
        libs = {f.rsplit("/", 1)[-1] for f in files if ".so" in f}
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    return [a.decode() for a in cmdline], libs, err


HEAVY = ("libstdc++", "libwebsockets", "libarchive", "libssl", "libuv", "libspdlog", "libidn2", "libunistring")


def static_pie(path):
    """Whether the ELF file at path is a static PIE: no program interpreter, no shared object."""
    out = subprocess.run(["readelf", "-ldW", str(path)], capture_output=True, text=True, check=True).stdout
    return "INTERP" not in out and "(NEEDED)" not in out


def test_ns_init_is_its_own_small_program_and_a_box_warns_of_nothing(tmp_path):
    # sandboxer-ns-init beside sandboxer-init: what every branch execs links little in. Built here
    # (glibc's archive present, no sanitizer), it links nothing at all: no loader, no libc.so.
    cmdline, libs, err = ns_init_of_a_sleeping_box(INIT, tmp_path / "s")
    assert cmdline == ["/run/sandboxer/bin/ns-init"]
    assert static_pie(INIT.parent / "sandboxer-ns-init")
    assert libs == set(), libs
    # Nothing but the shutdown's own line (a fresh state dir once warned of a missing chunk store).
    assert [line for line in err.decode().splitlines() if ": info [" not in line] == [], err


def test_without_sandboxer_ns_init_beside_it_ns_init_is_sandboxer_inits_own_mode(tmp_path):
    # An install that copied the one binary: the control for the test above, with ns-init the
    # supervisor's own --ns-init mode and all its libraries.
    lone = tmp_path / "bin"
    lone.mkdir()
    shutil.copy2(INIT, lone / "sandboxer-init")
    cmdline, libs, _ = ns_init_of_a_sleeping_box(lone / "sandboxer-init", tmp_path / "s")
    assert cmdline == ["/run/sandboxer/bin/ns-init", "--ns-init"]
    assert any(n.startswith(HEAVY) for n in libs), libs


def test_without_namespaces_the_box_says_why(tmp_path):
    r, out = sh(tmp_path, "echo $$", as_pid1=False)
    r2 = run_init(["--set", "isolation.namespaces=false", "--", "/bin/true"], tmp_path / "flat", as_pid1=False)
    assert r2.returncode == 0
    started = [e for e in read_journal(tmp_path / "flat") if e["type"] == "box.started"][0]
    caps = started["capabilities"]
    assert caps["namespaces"] is False and "off in the profile" in caps["namespaces_why_not"]
    assert caps["live_checkpoint"] is False and caps["why_not"]
    # Its agent sees the workspace alone of its branch's dir (its /tmp is the host's): the rest of
    # a layer (root, run, the /tmp overlay's dirs, ns-init's file, the machine id) is not made.
    # The control, with namespaces: the box above has them all.
    layer = {"machine-id", "root", "run", "tmp", "tmp-upper", "tmp-work", "workspace"}
    assert {p.name for p in (tmp_path / "s/branches/main").iterdir()} == layer
    assert {p.name for p in (tmp_path / "flat/branches/main").iterdir()} == {"workspace"}


def test_the_agent_inherits_only_stdio_and_its_channel(tmp_path):
    # ns-init's own request and report pipes must not leak into the agent (it could forge
    # reports); the agent gets 0..2 and the channel on 3 and 4 (SANDBOXER_CHANNEL_FD), nothing else.
    script = ("import os; fds = sorted(int(f) for f in os.listdir('/proc/self/fd')); "
              "print(fds); print(os.environ['SANDBOXER_CHANNEL_FD']); "
              "print([os.readlink(f'/proc/self/fd/{f}')[:5] for f in (3, 4)])")
    r = run_init(["--", "python3", "-c", script], tmp_path / "s")
    assert r.returncode == 0, r.stderr
    out = "".join(e.get("data", "") for e in read_journal(tmp_path / "s") if e["type"] == "proc.output")
    fds, chan, kinds = out.splitlines()[:3]
    fds = eval(fds)
    assert fds[:5] == [0, 1, 2, 3, 4] and len(fds) == 6, fds  # the sixth is listdir's own
    assert chan == "3,4" and kinds == "['pipe:', 'pipe:']"


def test_the_root_is_a_read_only_tmpfs_and_makes_nothing_on_the_hosts_disk(tmp_path):
    # Its mount points and symlinks live in a tmpfs of the branch's mount namespace: a start makes
    # ~20 fewer inodes on the host's disk. A live checkpoint writes them into its snapshot's root/
    # (criu restores onto them: tests/integration/test_checkpoint.py restores such snapshots).
    r, out = sh(tmp_path, "awk '$5 == \"/\" {print $6, $9}' /proc/self/mountinfo; touch /sbx-probe 2>&1;"
                          " test -d /usr/bin && echo usr")
    assert r.returncode == 0, r.stderr
    root_line, *rest = out.splitlines()
    opts, fstype = root_line.split()
    assert fstype == "tmpfs" and opts.split(",")[0] == "ro", root_line
    assert {"nosuid", "nodev", "noexec"} <= set(opts.split(",")), root_line
    assert "Read-only file system" in out
    assert "usr" in rest, out
    assert list((tmp_path / "s/branches/main/root").iterdir()) == []
