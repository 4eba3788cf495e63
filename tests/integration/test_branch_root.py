"""The branch's root: the host read-only, the workspace and /tmp writable and private, the
supervisor's state dir invisible, ns-init PID 1 of the agent's own pid namespace."""
import subprocess

from sbxtest import read_journal, run_init


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


def test_state_dir_is_masked(tmp_path):
    r, out = sh(tmp_path, f"ls -A {tmp_path / 's'} | wc -l; cat {tmp_path / 's/box.json'} 2>&1")
    assert out.splitlines()[0].strip() == "0"
    assert "No such file" in out or "Permission denied" in out


def test_the_agent_has_its_own_pid_namespace_under_ns_init(tmp_path):
    r, out = sh(tmp_path, "echo $$; cat /proc/1/cmdline | tr '\\0' ' '")
    pid, cmdline = out.splitlines()[:2]
    assert pid == "2"
    assert cmdline.startswith("/run/sandboxer/bin/sandboxer-init --ns-init")
    started = [e for e in read_journal(tmp_path / "s") if e["type"] == "box.started"][0]
    assert started["capabilities"]["namespaces"] is True


def test_without_namespaces_the_box_says_why(tmp_path):
    r, out = sh(tmp_path, "echo $$", as_pid1=False)
    r2 = run_init(["--set", "isolation.namespaces=false", "--", "/bin/true"], tmp_path / "flat", as_pid1=False)
    assert r2.returncode == 0
    started = [e for e in read_journal(tmp_path / "flat") if e["type"] == "box.started"][0]
    caps = started["capabilities"]
    assert caps["namespaces"] is False and "off in the profile" in caps["namespaces_why_not"]
    assert caps["live_checkpoint"] is False and caps["why_not"]


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
