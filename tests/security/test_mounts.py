"""Attacks on the agent's mounts and devices (issue #13 items 1 and 8, /sys, setuid): the agent,
root in its box, tries to write the kernel's settings through its fresh /proc and through /sys,
to read the kernel's memory, key and timer lists, to make and open a block device, and to gain
root from a setuid copy of a shell. Each refusal is asserted with the kernel's reason; each
control shows the same probe succeeding where the defence is off (SANDBOXER_CGROUP=none for the
devices cgroup) or, where no knob exists, on this host as root."""
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import uuid

import pytest

from sbxtest import INIT, box, output, read_journal, started

pytestmark = pytest.mark.timeout(60)

AGENT = pathlib.Path(__file__).resolve().parent / "agents" / "mounts.py"
PY = "/usr/bin/python3"
ROOT_PROFILES = ["default", "explorer", "claude-agent"]


def agent(*args):
    return [PY, str(AGENT), *[str(a) for a in args]]


def parse(text):
    """'<what> <path> <result> [n]' lines of the agent -> {(what, path): (result, n)}."""
    out = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) >= 3:
            extra = None if len(p) < 4 else int(p[3]) if p[3].isdigit() else p[3]
            out[(p[0], p[1])] = (p[2], extra)
    return out


def results(ev):
    return parse(output(ev))


def run(state_dir, args, *sets, profile=None, env=None):
    r, ev = box(state_dir, agent(*args), *sets, profile=profile, env=env)
    res = results(ev)
    assert res, (r.stderr, output(ev), output(ev, "stderr"))
    return res, ev


def on_host(args):
    """The same probe outside any box, as root on this host."""
    return parse(subprocess.run([PY, str(AGENT), *args], capture_output=True, text=True, timeout=20).stdout)


# --- /proc: the kernel's settings (item 1) -------------------------------------------------------

KERNEL_SETTINGS = ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches"]


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_proc_sys_opens_read_only_for_a_root_agent(state_dir, profile):
    res, ev = run(state_dir, ["write", *KERNEL_SETTINGS], profile=profile)
    for p in KERNEL_SETTINGS:
        assert res[("write", p)] == ("EROFS", None), res
    assert "/proc/sys" in started(ev)["enforcement"]["read_only"]


def test_proc_sys_opens_read_only_under_untrusted_run_as_root(state_dir):
    # untrusted runs as nobody, whom file permissions already stop: as root it must still be EROFS.
    res, _ = run(state_dir, ["write", *KERNEL_SETTINGS], "isolation.user=root", profile="untrusted")
    for p in KERNEL_SETTINGS:
        assert res[("write", p)] == ("EROFS", None), res


def test_proc_sys_control_on_the_host_opens_for_writing():
    res = on_host(["write", *KERNEL_SETTINGS])
    for p in KERNEL_SETTINGS:
        assert res[("write", p)] == ("ok", None), res


TRIGGERS = ["/proc/sysrq-trigger", "/proc/irq/default_smp_affinity"]


def test_proc_triggers_and_irq_open_read_only(state_dir):
    res, _ = run(state_dir, ["write", *TRIGGERS])
    for p in TRIGGERS:
        # A path this kernel lacks (no CONFIG_MAGIC_SYSRQ here) is absent in the box too.
        want = "EROFS" if os.path.exists(p) else "ENOENT"
        assert res[("write", p)] == (want, None), res


def test_proc_triggers_control_on_the_host():
    present = [p for p in TRIGGERS if os.path.exists(p)]
    assert present
    res = on_host(["write", *present])
    for p in present:
        assert res[("write", p)] == ("ok", None), res


# --- /proc and /sys: the kernel's lists and tables, masked --------------------------------------

KERNEL_LISTS = ["/proc/keys", "/proc/timer_list", "/proc/interrupts", "/proc/kcore", "/proc/sched_debug"]


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_kernel_lists_read_empty(state_dir, profile):
    res, ev = run(state_dir, ["read", *KERNEL_LISTS, "/proc/self/status"], profile=profile)
    for p in KERNEL_LISTS:
        want = ("ok", 0) if os.path.exists(p) else ("ENOENT", None)
        assert res[("read", p)] == want, res
    assert res[("read", "/proc/self/status")][1] > 0  # /proc itself still works
    assert "/proc/keys" in started(ev)["enforcement"]["masked"]


def test_kernel_lists_control_on_the_host_are_not_empty():
    present = [p for p in KERNEL_LISTS if os.path.exists(p)]
    assert "/proc/keys" in present and "/proc/timer_list" in present
    res = on_host(["read", *present])
    for p in present:
        assert res[("read", p)][0] == "ok" and res[("read", p)][1] > 0, res


def test_sys_firmware_is_an_empty_directory(state_dir):
    res, _ = run(state_dir, ["list", "/sys/firmware"])
    assert res[("list", "/sys/firmware")] in (("EACCES", None), ("ok", 0)), res


def test_sys_firmware_control_on_the_host_is_not_empty():
    res = on_host(["list", "/sys/firmware"])
    assert res[("list", "/sys/firmware")][0] == "ok" and res[("list", "/sys/firmware")][1] > 0, res


# --- /sys: read-only -----------------------------------------------------------------------------

SYS_WRITES = ["/sys/kernel/mm/transparent_hugepage/enabled"]


def host_cgroup_parent():
    # A cgroup directory the agent would make to escape its own group.
    for c in ("memory", "pids", "unified"):
        d = f"/sys/fs/cgroup/{c}"
        if os.path.isdir(d):
            return d
    pytest.skip("no cgroup mount under /sys/fs/cgroup")


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_sys_is_read_only(state_dir, profile):
    evil = f"{host_cgroup_parent()}/sbx-evil-{uuid.uuid4().hex[:6]}"
    res, ev = run(state_dir, ["write", *SYS_WRITES], profile=profile)
    res2, _ = run(state_dir / "2", ["mkdir", evil], profile=profile)
    for p in SYS_WRITES:
        assert res[("write", p)] == ("EROFS", None), res
    assert res2[("mkdir", evil)] == ("EROFS", None), res2
    assert started(ev)["enforcement"]["read_only"].startswith("/sys")


def test_sys_control_on_the_host_is_writable():
    evil = f"{host_cgroup_parent()}/sbx-evil-{uuid.uuid4().hex[:6]}"
    res = on_host(["write", *SYS_WRITES])
    res2 = on_host(["mkdir", evil])  # made and removed at once
    for p in SYS_WRITES:
        assert res[("write", p)] == ("ok", None), res
    assert res2[("mkdir", evil)] == ("ok", None), res2


# --- /sys: the branch's own cgroups and interfaces, not the host's -------------------------------

SYS_VIEW = ("for d in /sys/fs/cgroup/*/; do echo \"group $d $(find \"$d\" -mindepth 1 -maxdepth 1 -type d | wc -l)\"; done; "
            "echo \"limit $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || "
            "cat /sys/fs/cgroup/memory.max)\"; echo \"net $(ls /sys/class/net | tr '\\n' ,)\"; "
            "echo \"cg $(cut -d: -f3 /proc/self/cgroup | sort -u | tr '\\n' ,)\"")


def sys_view(text):
    out = {"groups": {}}
    for line in text.splitlines():
        p = line.split()
        if p[0] == "group":
            out["groups"][p[1]] = int(p[2])
        else:
            out[p[0]] = p[1] if len(p) > 1 else ""
    return out


@pytest.fixture
def other_group():
    """A group of the host's beside the box's (another tenant's), which the agent must not see."""
    d = pathlib.Path(host_cgroup_parent()) / f"sbx-other-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    yield d
    d.rmdir()


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_sys_fs_cgroup_shows_the_branch_its_own_groups_alone(state_dir, profile, other_group):
    # The host's /sys/fs/cgroup lists every group on it (other boxes', other containers') with
    # their usage; the agent's shows its own groups, each where its hierarchy is (a runtime reads
    # its limits there, as in a container), and none below them.
    r, ev = box(state_dir, ["/bin/sh", "-c", SYS_VIEW], "network.mode=none", "resources.memory=300m",
                profile=profile)
    v = sys_view(output(ev))
    assert v["groups"] and all(n == 0 for n in v["groups"].values()), (v, r.stderr)
    assert "/sys/fs/cgroup/memory/" in v["groups"] and v["limit"] == str(300 << 20), v
    assert v["net"] == "lo,", v
    # A cgroup namespace rooted at those groups: /proc/self/cgroup names each "/", where the
    # groups are mounted (so a runtime that joins the two finds them), and no path of the host's.
    assert v["cg"] == "/,", v
    assert started(ev)["capabilities"]["namespaces"] is True


def test_sys_fs_cgroup_control_on_the_host_shows_other_groups(other_group):
    # The same probe in a group of the host's: the groups beside it, and its path in /proc/self/cgroup.
    probe = f"echo $$ > {other_group}/cgroup.procs && {SYS_VIEW}"
    out = subprocess.run(["/bin/sh", "-c", probe], capture_output=True, text=True, timeout=20).stdout
    v = sys_view(out)
    parent = other_group.parent.name
    assert v["groups"][f"/sys/fs/cgroup/{parent}/"] >= 1, v
    assert other_group.name in v["cg"], v


# --- devices (item 8) ----------------------------------------------------------------------------

DEFAULT_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_NET_RAW", "CAP_SETGID",
                "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
                "CAP_AUDIT_WRITE"]
WITH_MKNOD = 'isolation.capabilities=["' + '","'.join(DEFAULT_CAPS + ["CAP_MKNOD"]) + '"]'


@pytest.mark.parametrize("where", ["/workspace", "/tmp"])
@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_mknod_block_device_refused(state_dir, where, profile):
    res, ev = run(state_dir, ["mknod", f"{where}/loop", "b", 7, 0], profile=profile)
    assert res[("mknod", f"{where}/loop")] == ("EPERM", None), res


def test_mknod_control_on_the_host_makes_and_opens_the_device(tmp_path):
    node = tmp_path / "loop"
    res = on_host(["mknod", str(node), "b", "7", "0"])
    assert res[("mknod", str(node))] == ("ok", None), res
    assert res[("read", str(node))][0] == "ok", res


@pytest.mark.parametrize("where", ["/workspace", "/tmp"])
def test_mknod_kept_by_the_profile_the_devices_cgroup_still_refuses(state_dir, where):
    # The profile keeps CAP_MKNOD: a null device (allowed) is made, so the capability is there;
    # the block device is refused by the devices cgroup; and the node made opens nothing (nodev).
    res, ev = run(state_dir, ["mknod", f"{where}/null", "c", 1, 3], WITH_MKNOD)
    res2, _ = run(state_dir / "2", ["mknod", f"{where}/loop", "b", 7, 0], WITH_MKNOD)
    assert res[("mknod", f"{where}/null")] == ("ok", None), res
    assert res[("read", f"{where}/null")] == ("EACCES", None), res
    assert res2[("mknod", f"{where}/loop")] == ("EPERM", None), res2
    assert "only c 1:3 rwm" in started(ev)["enforcement"]["devices"]


FLAT = ['isolation.capabilities=["ALL"]', "isolation.namespaces=[]"]


def host_block_device():
    for d in ("/dev/loop0", "/dev/vda", "/dev/sda", "/dev/nvme0n1"):
        if os.path.exists(d) and stat.S_ISBLK(os.stat(d).st_mode):
            return d
    pytest.skip("no block device on this host")


def test_devices_cgroup_refuses_a_host_block_device_without_namespaces(state_dir):
    # No mount namespace, every capability: the host's /dev is in view, and only the devices
    # cgroup stands between the agent and the disk.
    dev = host_block_device()
    res, ev = run(state_dir, ["read", dev, "/dev/null"], *FLAT)
    assert res[("read", dev)] == ("EPERM", None), res
    assert res[("read", "/dev/null")] == ("ok", 0), res
    assert started(ev)["enforcement"]["devices"].startswith("cgroup ")


def test_devices_cgroup_control_without_a_cgroup_the_device_opens(state_dir):
    dev = host_block_device()
    res, ev = run(state_dir, ["read", dev], *FLAT, env={**os.environ, "SANDBOXER_CGROUP": "none"})
    assert res[("read", dev)][0] == "ok", res
    assert started(ev)["enforcement"]["devices"].startswith("not enforced")


@pytest.fixture
def v2_parent():
    """A directory of this host's cgroup2 mount, for the v2 code on a hybrid host."""
    mount = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.split(" - ")
            if post.split()[0] == "cgroup2":
                mount = pre.split()[4]
                break
    if not mount:
        pytest.skip("no cgroup2 mount")
    d = f"{mount}/sbx-test-devices-{uuid.uuid4().hex[:6]}"
    os.mkdir(d)
    yield d
    for sub in sorted(pathlib.Path(d).glob("*/"), reverse=True):
        if (sub / "cgroup.procs").exists():
            sub.rmdir()
    os.rmdir(d)


def test_v2_device_program_refuses_a_host_block_device(state_dir, v2_parent):
    dev = host_block_device()
    res, ev = run(state_dir, ["read", dev, "/dev/null"], *FLAT, env={**os.environ, "SANDBOXER_CGROUP": "v2:" + v2_parent})
    assert res[("read", dev)] == ("EPERM", None), res
    assert res[("read", "/dev/null")] == ("ok", 0), res
    assert started(ev)["enforcement"]["devices"].startswith("cgroup v2 device program: only ")


def test_sys_fs_cgroup_on_v2_is_the_branch_group_itself(state_dir, v2_parent):
    # On cgroup v2 the branch's group is the agent's whole /sys/fs/cgroup: its own processes in
    # it, and neither a group beside it (made here, as another tenant's) nor any above it.
    (pathlib.Path(v2_parent) / "sbx-other").mkdir()
    cmd = ("echo dirs $(find /sys/fs/cgroup -mindepth 1 -type d | wc -l); "
           "echo procs $(tr '\\n' , < /sys/fs/cgroup/cgroup.procs); echo cg $(grep '^0::' /proc/self/cgroup)")
    r, ev = box(state_dir, ["/bin/sh", "-c", cmd], env={**os.environ, "SANDBOXER_CGROUP": "v2:" + v2_parent})
    lines = dict(line.split(" ", 1) for line in output(ev).splitlines())
    assert lines.get("dirs") == "0" and "1" in lines.get("procs", "").split(","), (lines, r.stderr)
    assert lines.get("cg") == "0::/", lines  # its cgroup namespace's root is that group
    assert started(ev)["capabilities"]["namespaces"] is True


# --- setuid and nodev on writable mounts --------------------------------------------------------

SHELL_CHECK = ["-p", "-c", "echo ruid=$(id -ru) euid=$(id -u)"]


@pytest.fixture
def var_state():
    """A state dir on the host's root filesystem, so the control can run its file in place."""
    d = pathlib.Path(f"/var/tmp/sbx-mounts-{uuid.uuid4().hex[:8]}")
    d.mkdir(mode=0o755)
    yield d / "state"
    shutil.rmtree(d, ignore_errors=True)


def test_setuid_shell_made_in_the_workspace_gains_nothing(var_state):
    # Root in the box makes a setuid-root bash in /workspace, then runs it as nobody.
    cmd = (f"{PY} {AGENT} setuid-copy /bin/bash /workspace/suid-bash && "
           f"setpriv --reuid 65534 --regid 65534 --clear-groups /workspace/suid-bash {' '.join(map(repr, SHELL_CHECK))}")
    r, ev = box(var_state, ["/bin/sh", "-c", cmd])
    out = output(ev)
    assert "setuid-copy /workspace/suid-bash ok" in out, (out, output(ev, "stderr"))
    assert "ruid=65534 euid=65534" in out, out
    # Two locks: no_new_privs, and the workspace is mounted nosuid.
    res, _ = run(var_state / "2", ["mounts"])
    assert "nosuid" in res[("mount", "/workspace")][1].split(","), res


def test_setuid_shell_control_the_same_file_on_the_host_gains_root(var_state):
    cmd = f"{PY} {AGENT} setuid-copy /bin/bash /workspace/suid-bash"
    box(var_state, ["/bin/sh", "-c", cmd])
    made = list(var_state.glob("branches/*/workspace/suid-bash"))
    assert made, list(var_state.rglob("*"))
    for p in [made[0], *made[0].parents]:
        if p == var_state.parent:
            break
        p.chmod(p.stat().st_mode | 0o555)
    assert made[0].stat().st_mode & stat.S_ISUID
    out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", str(made[0]),
                          *SHELL_CHECK], capture_output=True, text=True, timeout=10).stdout
    assert "ruid=65534 euid=0" in out, out


def test_every_writable_mount_is_nosuid_and_nodev(state_dir):
    res, ev = run(state_dir, ["mounts"])
    # Agent-visible mounts that are writable; /dev's device binds and devpts carry devices.
    bad = []
    for line in output(ev).splitlines():
        parts = line.split()
        if parts[0] != "mount":
            continue
        point, fstype, opts = parts[1], parts[2], parts[3].split(",")
        if "rw" not in opts or fstype in ("devtmpfs", "devpts"):
            continue
        if "nosuid" not in opts or "nodev" not in opts:
            bad.append((point, fstype, opts))
    assert not bad, bad
    assert ("mount", "/workspace") in res and ("mount", "/run") in res


# --- the host's inodes the box is given: devices, resolv.conf, the branches' dir ---------------

# Changes nothing if it works (the same mode, the same owner, a new time): what root in the box
# could do to the host's inode behind each bind.
INODE_PROBE = r'''
import os, sys
for path in sys.argv[1:]:
    st = os.stat(path)
    for what, fn in (("chmod", lambda: os.chmod(path, st.st_mode & 0o7777)),
                     ("chown", lambda: os.chown(path, st.st_uid, st.st_gid)),
                     ("utime", lambda: os.utime(path))):
        try:
            fn()
            print(what, path, "ok")
        except OSError as e:
            print(what, path, e.errno)
with open("/dev/null", "w") as f:
    print("write", "/dev/null", "ok" if f.write("x") == 1 else "short")
'''
HOST_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"]


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_the_hosts_device_inodes_cannot_be_changed_from_the_box(state_dir, profile):
    # The box's /dev holds binds of the host's own device inodes. They were writable binds: root in
    # the box chmod-ed and chown-ed the host's /dev/null (every other user of the host loses it).
    before = {d: os.stat(d).st_ctime_ns for d in HOST_DEVICES if os.path.exists(d)}
    r, ev = box(state_dir, [PY, "-c", INODE_PROBE, *before], profile=profile)
    res = parse(output(ev))
    assert res[("write", "/dev/null")] == ("ok", None), (output(ev), output(ev, "stderr"))
    for d in before:
        for what in ("chmod", "chown", "utime"):
            assert res[(what, d)] == ("30", None), (what, d, res)  # EROFS
    assert {d: os.stat(d).st_ctime_ns for d in before} == before


def test_the_hosts_device_inodes_control_a_writable_bind_changes_them(tmp_path):
    # The same probe through a plain bind (the box's before the fix), in a mount namespace of its
    # own, of a node like the host's /dev/null (not that one: the test above watches it): the
    # inode behind the bind is changed.
    node, spot = tmp_path / "null", tmp_path / "spot"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    spot.touch()
    before = os.stat(node).st_ctime_ns
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'mount --bind "{node}" "{spot}" && exec {PY} -c "$0" "{spot}"', INODE_PROBE],
                         capture_output=True, text=True, timeout=20)
    res = parse(out.stdout)
    assert res[("chmod", str(spot))] == ("ok", None), (out.stdout, out.stderr)
    assert os.stat(node).st_ctime_ns != before


def test_the_branchs_resolv_conf_is_read_only(state_dir):
    # With a network of its own the box's /etc/resolv.conf is a bind of a file in the state dir
    # (branches/<name>/resolv.conf), which the agent wrote through, past any disk ceiling.
    script = ("import errno\ntry:\n    open('/etc/resolv.conf', 'a').write('x' * 4096)\n    print('append ok')\n"
              "except OSError as e:\n    print('append', errno.errorcode[e.errno])\n"
              "print('read', open('/etc/resolv.conf').read().strip())")
    r, ev = box(state_dir, [PY, "-c", script], "network.mode=none")
    assert "append EROFS" in output(ev), (output(ev), output(ev, "stderr"))
    assert "read nameserver 127.0.0.1" in output(ev)
    assert (state_dir / "branches" / "main" / "resolv.conf").read_text() == "nameserver 127.0.0.1\n"


def test_a_setuid_file_an_agent_leaves_is_out_of_reach_of_the_hosts_users(var_state):
    # A state dir made by hand with the usual 0755: the supervisor took it, and the branches' dirs
    # under it were 0755 too, so any user of the host ran the setuid-root shell an agent left in
    # its workspace (the host's disk is not nosuid). The dir of the branches' dirs is 0700 now; a
    # reused state dir's is narrowed. The control above (..._control_the_same_file_on_the_host...)
    # opens the same path up and gains root.
    var_state.mkdir(mode=0o755)
    (var_state / "branches").mkdir(mode=0o755)  # as a box of an earlier version left it
    box(var_state, ["/bin/sh", "-c", f"{PY} {AGENT} setuid-copy /bin/bash /workspace/suid-bash"])
    made = var_state / "branches" / "main" / "workspace" / "suid-bash"
    assert made.stat().st_mode & stat.S_ISUID  # it is there, set-id bit and all
    assert stat.S_IMODE((var_state / "branches").stat().st_mode) == 0o700
    # As nobody through setuid(2) in the child (setpriv keeps its capabilities until the exec, whose
    # path it would look up as root).
    with pytest.raises(PermissionError):
        subprocess.run([str(made), *SHELL_CHECK], user=65534, group=65534, extra_groups=[], timeout=10)


# --- the host's mounts beneath the directories the box sees ------------------------------------

@pytest.fixture
def host_dir():
    """An empty directory under /var/tmp (beneath /var, a directory every box sees), removed after."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="sbx-hostmounts-", dir="/var/tmp"))
    (d / "proc").mkdir()
    (d / "data").mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def box_after_host_mounts(state_dir, setup, probe, sets=(), profile=None):
    """A box running `sh -c PROBE`, started in a mount namespace of its own in which the shell
    command SETUP made mounts on the host's paths first: the suite's other boxes never see them
    (one of them checkpointed meanwhile would carry them). `sets`: --set assignments."""
    args = [a for s in sets for a in ("--set", s)] + (["--profile", profile] if profile else [])
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", setup + ' && exec "$@"', "sh", str(INIT),
           "--state-dir", str(state_dir), *args, "--", "sh", "-c", probe]
    r = subprocess.run(cmd, capture_output=True, timeout=60)
    return r, read_journal(state_dir)


def box_beside_host_mounts(state_dir, d, *sets, profile=None):
    """A box that lists the host's processes a /proc of the host's pid namespace at D/proc shows (as
    a chroot's build mounts one) and reads the file of a tmpfs at D/data (box_after_host_mounts)."""
    setup = f"mount -t proc proc {d}/proc && mount -t tmpfs tmpfs {d}/data && echo 'host data' > {d}/data/f"
    return box_after_host_mounts(state_dir, setup, f'ls {d}/proc | grep -c "^[0-9]*$"; cat {d}/data/f', sets, profile)


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_a_host_proc_beneath_the_hosts_directories_is_not_in_the_agents_view(state_dir, host_dir, profile):
    # The agent saw the host's processes and their command lines through it (and a snapshot carried
    # the mount, whose restore failed once the host had unmounted it). Other mounts stay.
    r, ev = box_beside_host_mounts(state_dir, host_dir, profile=profile)
    assert output(ev) == "0\nhost data\n", (output(ev), r.stderr)


def test_a_host_proc_control_without_namespaces_lists_the_hosts_processes(state_dir, host_dir):
    r, ev = box_beside_host_mounts(state_dir, host_dir, "isolation.namespaces=false")
    n, data = output(ev).splitlines()[:2]
    assert int(n) > 10 and data == "host data", (output(ev), r.stderr)


# --- a pod's service-account token --------------------------------------------------------------

def box_in_a_pod_view(state_dir, profile):
    """A box whose host has /var/run as a directory of its own, with a tmpfs holding a token at
    /var/run/secrets/kubernetes.io/serviceaccount (as Kubernetes mounts one into a container whose
    image has no /var/run symlink) and a file beside it at /var/run/other/f. /var is a tmpfs of a
    mount namespace the box starts in (this host's /var/run is the usual symlink to /run)."""
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    setup = (f"mount -t tmpfs tmpfs /var && mkdir -p {sa} /var/run/other && mount -t tmpfs tmpfs {sa} && "
             f"echo sa-token > {sa}/token && echo other > /var/run/other/f")
    probe = f"cat {sa}/token; cat /var/run/other/f; ls -A /var/run/secrets; echo end"
    return box_after_host_mounts(state_dir, setup, probe, profile=profile)


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_a_pods_service_account_token_under_a_var_run_directory_is_masked(state_dir, profile):
    # /var is a directory every box sees read-only, with the mounts beneath it: the token was read
    # (the API server's credentials of the pod). /run is the branch's own, so where /var/run is the
    # usual symlink there was nothing to see. The file beside it, in no mask, is the control: the
    # box does see what is mounted beneath /var/run.
    r, ev = box_in_a_pod_view(state_dir, profile)
    assert output(ev) == "other\nend\n", (output(ev), output(ev, "stderr"), r.stderr)
    assert "sa-token" not in output(ev, "stderr")


# --- the host's own secrets under /etc ----------------------------------------------------------

HOST_SECRETS = ["/etc/shadow", "/etc/gshadow", "/etc/ssh/ssh_host_ed25519_key"]


def box_reading_host_secrets(state_dir, *sets, profile=None):
    """A box that prints the size of each of HOST_SECRETS, /etc/passwd and /etc/ssh/ssh_config,
    then what /etc/ssl/private lists. The box starts in a mount namespace whose /etc/ssh is a
    tmpfs holding a host key and a client config (this host runs no SSH daemon)."""
    setup = ("mount -t tmpfs tmpfs /etc/ssh && echo 'PRIVATE KEY' > /etc/ssh/ssh_host_ed25519_key && "
             "chmod 600 /etc/ssh/ssh_host_ed25519_key && echo 'Host *' > /etc/ssh/ssh_config")
    files = " ".join(HOST_SECRETS + ["/etc/passwd", "/etc/ssh/ssh_config"])
    probe = f"for f in {files}; do echo $f $(cat $f | wc -c); done; echo private $(ls -A /etc/ssl/private | wc -l)"
    r, ev = box_after_host_mounts(state_dir, setup, probe, sets, profile)
    sizes = dict(line.split() for line in output(ev).splitlines())
    return r, {k: int(v) for k, v in sizes.items()}


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_the_hosts_password_hashes_and_private_keys_are_masked(state_dir, profile):
    # Root in the box read the host's /etc/shadow and /etc/gshadow whole, its TLS private keys
    # (/etc/ssl/private) and the SSH daemon's host keys, with which an agent could pass for the host.
    r, sizes = box_reading_host_secrets(state_dir, profile=profile)
    assert all(sizes[f] == 0 for f in HOST_SECRETS), (sizes, r.stderr)
    assert sizes["private"] == 0, sizes
    # What sits beside them is read as it is.
    assert sizes["/etc/passwd"] == os.path.getsize("/etc/passwd") and sizes["/etc/ssh/ssh_config"] == len("Host *\n")


def test_the_hosts_password_hashes_control_without_namespaces_are_read(state_dir):
    r, sizes = box_reading_host_secrets(state_dir, "isolation.namespaces=false")
    assert sizes["/etc/shadow"] == os.path.getsize("/etc/shadow") > 0, (sizes, r.stderr)
    assert sizes["/etc/ssh/ssh_host_ed25519_key"] == len("PRIVATE KEY\n")
    private = pathlib.Path("/etc/ssl/private")
    assert sizes["private"] == (len(os.listdir(private)) if private.is_dir() else 0)


@pytest.mark.parametrize("profile", ROOT_PROFILES)
def test_a_profiles_masks_hide_more_host_paths(state_dir, profile, tmp_path):
    # The README said to "mask more paths in the profile", and no profile field did.
    probe = "echo hostname $(cat /etc/hostname | wc -c); echo apt $(ls -A /etc/apt | wc -l)"
    def sizes(state, *sets):
        args = [a for s in sets for a in ("--set", s)]
        r = subprocess.run([str(INIT), "--state-dir", str(state), "--profile", profile, *args, "--", "sh", "-c", probe],
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return dict(line.split() for line in output(read_journal(state)).splitlines())
    masked = sizes(state_dir, 'isolation.masks=["/etc/hostname", "/etc/apt", "/no/such/path"]')
    assert masked == {"hostname": "0", "apt": "0"}, masked
    # The control: the same box without them reads both.
    plain = sizes(tmp_path / "plain")
    assert int(plain["hostname"]) == os.path.getsize("/etc/hostname") > 0 and int(plain["apt"]) > 0, plain
