"""sandboxer doctor: one line per capability of this host, checked against the host itself."""
import ctypes
import json
import os
import subprocess

import pytest

from sbxtest import CLI

pytestmark = pytest.mark.timeout(60)

CAPS = ["cgroup", "seccomp", "landlock", "namespaces", "overlayfs", "criu", "ksm", "disk", "profile", "privileges"]


def landlock_abi():
    libc = ctypes.CDLL(None, use_errno=True)
    return max(0, libc.syscall(444, None, 0, 1))  # landlock_create_ruleset(NULL, 0, VERSION)


def test_doctor_prints_one_line_per_capability():
    r = subprocess.run([str(CLI), "doctor"], capture_output=True, text=True, timeout=30)
    lines = [l for l in r.stdout.splitlines() if l.startswith(("ok ", "missing "))]
    assert [l.split()[1] for l in lines] == CAPS, r.stdout
    assert r.returncode in (0, 1)


def test_doctor_json_matches_this_host():
    r = subprocess.run([str(CLI), "doctor", "--json"], capture_output=True, text=True, timeout=30)
    d = json.loads(r.stdout)
    assert set(CAPS) <= set(d)
    abi = landlock_abi()
    assert d["landlock"]["ok"] == (abi > 0)
    if abi:
        assert d["landlock"]["detail"].startswith(f"ABI {abi}")
    v1 = any(l.split(":")[1] for l in open("/proc/self/cgroup").read().splitlines())
    assert d["cgroup"]["detail"].startswith("v1" if v1 else "v2")
    if v1 and d["cgroup"]["ok"]:
        # What a process joining its groups took, measured (README, Hosts).
        moved = d["cgroup"]["detail"].split("a process joining its groups took ")[1]
        assert float(moved.split(" ms")[0]) > 0, moved
    # overlayfs is tried for real, as a branch's /tmp is mounted: here with volatile (Linux 5.10+).
    if "\toverlay\n" in open("/proc/filesystems").read():
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
        assert d["overlayfs"]["ok"] and d["overlayfs"]["detail"].startswith("mounts"), d["overlayfs"]
        assert ("volatile too" in d["overlayfs"]["detail"]) == ((major, minor) >= (5, 10)), d["overlayfs"]
    try:
        ksm = open("/sys/kernel/mm/ksm/run").read().strip() == "1"
    except OSError:
        ksm = False
    assert d["ksm"]["ok"] == ksm
    for name, e in d.items():
        if isinstance(e, dict) and not e["ok"]:
            assert e.get("meaning"), name  # every missing one says what it means for profiles


def test_doctor_refuses_an_unknown_option():
    r = subprocess.run([str(CLI), "doctor", "--fast"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--fast" in r.stderr


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "env", "HOME=/nonexistent"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
def test_doctor_as_a_user_without_privileges_says_the_default_profile_is_refused():
    # What `sandboxer run` as that user does (test_pid1 has the box's refusal): the doctor says so
    # first, and fails. As root (the control) the same line is ok.
    d = json.loads(subprocess.run([str(CLI), "doctor", "--json"], capture_output=True, text=True, timeout=30).stdout)
    assert d["privileges"]["ok"], d["privileges"]
    r = subprocess.run([*NOBODY, str(CLI), "doctor", "--json"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stderr
    p = json.loads(r.stdout)["privileges"]
    assert not p["ok"] and p["detail"].startswith("uid 65534"), p
    assert "which takes CAP_SETGID, CAP_SETUID and CAP_SETPCAP, and this supervisor (uid 65534)" in p["meaning"], p


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
def test_doctor_rootless_says_there_is_no_live_checkpoint():
    r = subprocess.run([*NOBODY, "unshare", "--user", "--map-root-user", str(CLI), "doctor", "--json"],
                       capture_output=True, text=True, timeout=30)
    p = json.loads(r.stdout)["privileges"]
    assert p["ok"] and "in a user namespace of its own (rootless)" in p["detail"], p
    assert "no live checkpoint: criu cannot suspend an agent's seccomp filter" in p["meaning"], p


def test_doctor_names_a_default_profile_that_does_not_load_and_fails(tmp_path):
    # It once showed as a privileges failure, from the check that loads the profile to read its
    # user. The control: the shipped one loads.
    d = json.loads(subprocess.run([str(CLI), "doctor", "--json"], capture_output=True, text=True, timeout=30).stdout)
    assert d["profile"]["ok"] and d["profile"]["detail"].startswith("default, from "), d["profile"]
    (tmp_path / "default.json").write_text('{"name": "default", "version": 1, "resources": {"grase": "1s"}}')
    env = dict(os.environ, SANDBOXER_PROFILE_DIR=str(tmp_path))
    r = subprocess.run([str(CLI), "doctor", "--json"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 1, r.stdout
    d = json.loads(r.stdout)
    assert not d["profile"]["ok"], d["profile"]
    assert d["profile"]["detail"] == f"{tmp_path}/default.json: resources.grase: unknown field", d["profile"]
    assert d["profile"]["meaning"] == "a box started here without --profile refuses to start"
    assert d["privileges"]["ok"] and "it did not load (the profile line)" in d["privileges"]["meaning"]
    # What the line foretells.
    r = subprocess.run([str(CLI), "run", "--", "true"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode != 0 and "resources.grase: unknown field" in r.stderr, r.stderr
