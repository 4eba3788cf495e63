"""A box whose pid and mount namespaces fail (the host refuses them, or a step of their mount plan
fails) once ran its agent without them, with a warning: on a bare host, as root, with Docker's
default capabilities, the agent then had the host's filesystem writable, the host's processes in
sight and the box's token and journal readable. Now `isolation.without_namespaces` decides: "auto"
(every shipped profile) refuses where the supervisor is root in the host's user namespace and
holds CAP_SYS_ADMIN or has no container around it, "refuse" always, "run" never. The controls run
the same agent with "run": it writes the host's file."""
import errno
import os
import platform
import re
import subprocess

import pytest

from sbxtest import INIT, PROBE, read_journal, started

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

MOVE_MOUNT = 429  # x86_64
REFUSED = re.compile(r"no pid and mount namespace for the branch \((.*)\), and it may not run without them: (.*)")


def in_container():
    # What the supervisor takes for a container around it (sandbox/capabilities.cpp).
    return (os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
            or "KUBERNETES_SERVICE_HOST" in os.environ)


def run_box(wrap, tmp_path, mode):
    """The agent writes its uid into a file of the host's, outside the box's state dir."""
    state = tmp_path / "state"
    host_file = tmp_path / "written-by-the-agent"
    sets = ["--set", f"isolation.without_namespaces={mode}"] if mode else []
    r = subprocess.run([*wrap, str(INIT), "--state-dir", str(state), *sets, "--", "/bin/sh", "-c",
                        f"id -u > {host_file}"], capture_output=True, text=True, timeout=60)
    return r, state, host_file


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter names move_mount by its x86_64 number")
@pytest.mark.parametrize("mode", [None, "refuse", "run"], ids=["auto", "refuse", "run-control"])
def test_a_root_supervisor_whose_mount_plan_fails_does_not_run_its_agent_on_the_host(tmp_path, mode):
    # As root holding CAP_SYS_ADMIN (this host, or a privileged container), under a seccomp filter
    # refusing move_mount(2), as a host whose policy predates the new mount API would: the plan's
    # first attach fails. The clone itself succeeds; a plain bug of the plan fails the same way.
    r, state, host_file = run_box([str(PROBE), "deny", str(MOVE_MOUNT), str(errno.EPERM)], tmp_path, mode)
    if mode == "run":
        # The control: the agent ran as the host's root, outside any box, and wrote the host's file.
        assert r.returncode == 0, r.stderr
        assert host_file.read_text() == "0\n"
        caps = started(read_journal(state))["capabilities"]
        assert caps["namespaces"] is False and re.fullmatch(r"attach /\S+: Operation not permitted",
                                                            caps["namespaces_why_not"]), caps
        return
    assert r.returncode == 125, r.stderr
    m = REFUSED.search(r.stderr)
    assert m, r.stderr
    assert re.fullmatch(r"attach /\S+: Operation not permitted", m[1]), m[1]
    if mode == "refuse":
        assert m[2] == "the profile's isolation.without_namespaces is \"refuse\"", m[2]
    elif in_container():
        assert m[2].startswith("the supervisor is root holding CAP_SYS_ADMIN (a host, or a privileged container)"), m[2]
    else:
        assert m[2].startswith("the supervisor is root on this host, with no container around it"), m[2]
    assert not host_file.exists()
    # Nothing was started: no agent; the journal, where it was opened, says only why the box ended.
    ev = read_journal(state) if (state / "journal").exists() else []
    assert [e["type"] for e in ev] in ([], ["box.exited"]), ev
    assert not ev or (ev[0]["reason"] == "failed" and m[1] in ev[0]["error"]), ev


@pytest.mark.parametrize("mode", [None, "refuse", "run"], ids=["auto", "refuse", "run"])
def test_a_root_supervisor_without_cap_sys_admin_runs_flat_only_inside_a_container(tmp_path, mode):
    # Root without CAP_SYS_ADMIN (a container's init as Docker starts it by default, or a service
    # whose bounding set left it out): the clone of the namespaces is refused. Inside a container
    # the container still holds the agent in, and "auto" runs it flat, saying why; on a bare host
    # it would be the host's root, and "auto" refuses.
    wrap = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]
    r, state, host_file = run_box(wrap, tmp_path, mode)
    if mode == "run" or (mode is None and in_container()):
        assert r.returncode == 0, r.stderr
        assert host_file.read_text() == "0\n"
        caps = started(read_journal(state))["capabilities"]
        assert caps["namespaces"] is False, caps
        assert caps["namespaces_why_not"] == "clone(CLONE_NEWPID|CLONE_NEWNS): Operation not permitted", caps
        return
    assert r.returncode == 125, r.stderr
    m = REFUSED.search(r.stderr)
    assert m and m[1] == "clone(CLONE_NEWPID|CLONE_NEWNS): Operation not permitted", r.stderr
    assert not host_file.exists()
