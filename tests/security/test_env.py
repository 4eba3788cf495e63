"""The agent's environment (issue #13, item 3): the operator's shell must not reach the agent.

Before, the agent inherited the supervisor's whole environment: an AWS_SECRET_ACCESS_KEY set in
the shell that ran `sandboxer run` was in the agent's os.environ. Now the agent starts clean
(PATH, HOME, TERM, LANG, its SANDBOXER_* identity, the profile's `env`, `--env K=V`,
`exec{env}`); `--env-inherit` is the control that brings the old behaviour back."""
import json
import os
import pathlib
import secrets
import subprocess
import sys

import pytest

from sbxtest import CLI, WsBox, of_type, read_journal, run_init, started


pytestmark = pytest.mark.timeout(60)

AGENT = pathlib.Path(__file__).resolve().parent / "agents" / "env.py"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IDENTITY = {"SANDBOXER_BOX", "SANDBOXER_BRANCH", "SANDBOXER_WORKSPACE", "SANDBOXER_CHANNEL_FD"}


def marker():
    return "sbx-secret-" + secrets.token_hex(12)


def agent_report(state_dir, args, names, env):
    """Runs the env agent in a box; returns (its report, the run, the journal)."""
    r = run_init([*args, "--", "python3", str(AGENT), *names], state_dir, env=env)
    ev = read_journal(state_dir)
    msgs = [e["message"] for e in of_type(ev, "proc.message") if "environ" in e["message"]]
    assert msgs, (r.returncode, r.stderr.decode(errors="replace")[-2000:])
    return msgs[0], r, ev


def test_the_operators_secret_does_not_reach_the_agent(state_dir):
    secret = marker()
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=secret, TERM="xterm-test", LANG="C.UTF-8")
    rep, r, ev = agent_report(state_dir, [], [f"AWS_SECRET_ACCESS_KEY={secret}"], env)
    assert r.returncode == 0, r.stderr
    found = rep["found"]["AWS_SECRET_ACCESS_KEY"]
    assert not found["in_environ"] and not found["in_proc_environ"], found
    assert secret not in json.dumps(rep["environ"])
    # What it does get: a fixed PATH, root's HOME, the terminal and locale, who it is.
    e = rep["environ"]
    assert set(e) == {"PATH", "HOME", "TERM", "LANG"} | IDENTITY, sorted(e)
    assert e["PATH"] == DEFAULT_PATH and e["HOME"] == "/root"
    assert e["TERM"] == "xterm-test" and e["LANG"] == "C.UTF-8"
    # Nor is it in the journal beyond the probe's own command line (the supervisor never passed it on).
    assert secret not in json.dumps([e for e in ev if e["type"] != "proc.started"])


def test_control_with_env_inherit_the_secret_is_there(state_dir):
    secret = marker()
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=secret)
    rep, r, _ = agent_report(state_dir, ["--env-inherit"], [f"AWS_SECRET_ACCESS_KEY={secret}"], env)
    assert r.returncode == 0, r.stderr
    found = rep["found"]["AWS_SECRET_ACCESS_KEY"]
    assert found["in_environ"] and found["in_proc_environ"] and found["value"] == secret, found
    # Even inherited, the supervisor's token never is.
    assert not any(k.startswith("SANDBOXER_TOKEN") for k in rep["environ"])


def test_env_options_and_the_profile_env_reach_the_agent(state_dir, tmp_path):
    profile = json.loads((pathlib.Path(__file__).resolve().parents[2] / "profiles" / "default.json").read_text())
    profile["env"] = {"FROM_PROFILE": "p", "BOTH": "profile", "PATH": "/opt/x/bin:/usr/bin:/bin"}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    env = dict(os.environ, BY_NAME="ours", NOT_NAMED="hidden")
    args = ["--profile", str(tmp_path / "p.json"), "--set", "env.FROM_SET=8080",
            "--env", "FROM_FLAG=a=b", "--env", "BOTH=flag", "--env", "BY_NAME", "--env", "UNSET_HERE"]
    names = ["FROM_PROFILE", "FROM_SET", "FROM_FLAG", "BOTH", "BY_NAME", "NOT_NAMED", "UNSET_HERE"]
    rep, r, _ = agent_report(state_dir, args, names, env)
    assert r.returncode == 0, r.stderr
    e = rep["environ"]
    assert e["FROM_PROFILE"] == "p" and e["FROM_SET"] == "8080" and e["FROM_FLAG"] == "a=b"
    assert e["BOTH"] == "flag"            # --env wins over the profile
    assert e["BY_NAME"] == "ours"         # --env NAME takes the supervisor's value
    assert "NOT_NAMED" not in e and "UNSET_HERE" not in e
    assert e["PATH"] == "/opt/x/bin:/usr/bin:/bin"  # the profile may set PATH


@pytest.mark.parametrize("how", ["flag", "profile"])
def test_the_supervisors_own_names_cannot_be_set(state_dir, how):
    args = ["--env", "SANDBOXER_BOX=forged"] if how == "flag" else ["--set", "env.SANDBOXER_TOKEN=forged"]
    r = run_init([*args, "--", "true"], state_dir)
    err = r.stderr.decode()
    assert r.returncode == 125, err
    assert "is the supervisor's own" in err, err


def test_exec_env_still_reaches_the_agents_processes(state_dir, tmp_path):
    secret = marker()
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=secret)
    with WsBox(tmp_path, ["sleep", "60"], extra=["--env", "FROM_FLAG=1"], env=env) as box:
        r = subprocess.run([str(CLI), "exec", box.url, "--token-file", str(box.token_file), "--env", "FROM_EXEC=2",
                            "--", "python3", str(AGENT), "AWS_SECRET_ACCESS_KEY"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout.strip().splitlines()[-1])
        e = rep["environ"]
        assert e["FROM_EXEC"] == "2" and e["FROM_FLAG"] == "1"
        assert not rep["found"]["AWS_SECRET_ACCESS_KEY"]["in_environ"]


def test_sandboxer_run_passes_env_and_keeps_the_rest_out(state_dir):
    secret = marker()
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=secret)
    r = subprocess.run([str(CLI), "run", "--state-dir", str(state_dir), "--env", "GIVEN=yes", "--",
                        "python3", str(AGENT), "AWS_SECRET_ACCESS_KEY", "GIVEN"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = next(e["message"] for e in read_journal(state_dir) if e["type"] == "proc.message")
    assert rep["found"]["GIVEN"]["value"] == "yes"
    assert not rep["found"]["AWS_SECRET_ACCESS_KEY"]["in_environ"]
    assert started(read_journal(state_dir))


FAKE_DOCKER = """#!/bin/sh
# Records each docker command line (one argument a line, then a blank line); a `run` "starts" a
# container that has already exited, so `sandboxer up` gives up at once.
for a in "$@"; do printf '%s\\n' "$a"; done >> "$FAKE_DOCKER_LOG"
echo >> "$FAKE_DOCKER_LOG"
case "$1" in
  network) exit 1 ;;
  inspect) echo exited ;;
esac
exit 0
"""


def test_sandboxer_up_hands_env_to_the_supervisor_in_the_container(tmp_path):
    # The container's own environment (the image's, docker's) does not reach the agent: what the
    # agent gets must be on sandboxer-init's command line, after the image.
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER)
    fake.chmod(0o755)
    log = tmp_path / "docker.log"
    env = dict(os.environ, SANDBOXER_DOCKER=str(fake), FAKE_DOCKER_LOG=str(log), XDG_STATE_HOME=str(tmp_path / "xdg"),
               BY_NAME="ours", AWS_SECRET_ACCESS_KEY=marker())
    r = subprocess.run([str(CLI), "up", "--host", "docker", "--image", "sbx-fake:1", "--env", "GIVEN=yes", "--env", "BY_NAME",
                        "--", "true"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "ended before its API answered" in r.stderr, r.stderr
    runs = [c.splitlines() for c in log.read_text().split("\n\n") if c.startswith("run\n")]
    assert len(runs) == 1, log.read_text()
    args = runs[0]
    after_image = args[args.index("sbx-fake:1") + 1:]
    assert after_image[after_image.index("--env") + 1] == "GIVEN=yes", after_image
    assert "BY_NAME=ours" in after_image
    assert env["AWS_SECRET_ACCESS_KEY"] not in "\n".join(args)
    # And the same names are refused before anything runs.
    bad = subprocess.run([str(CLI), "up", "--host", "docker", "--env", "SANDBOXER_TOKEN=x", "--", "true"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert bad.returncode != 0 and "is the supervisor's own" in bad.stderr, bad.stderr


FAKE_DOCKER_FORK = """#!/usr/bin/env python3
# A docker that knows one box (FAKE_BOX_URL, started with --env KEPT=1) and whose new containers
# exit at once (so the fork fails after `docker run`); it records every `run` command line as a
# JSON line.
import json, os, sys
a = sys.argv[1:]
if a[0] == "run":
    open(os.environ["FAKE_DOCKER_LOG"], "a").write(json.dumps(a) + "\\n")
elif a[0] == "ps":
    print("sbx-orig\\t%s\\t/nonexistent\\timg\\tUp" % os.environ["FAKE_BOX_URL"])
elif a[0] == "inspect" and "--format" in a:
    print("exited")
elif a[0] == "inspect":
    print(json.dumps([{"Image": "sha256:fake", "Args": ["--state-dir", "/var/lib/sandboxer/state", "--env", "KEPT=1",
                       "--", "sleep", "60"], "Mounts": [{"Type": "bind", "Source": os.environ["FAKE_PROFILE"],
                       "Destination": "/etc/sandboxer/profile.json", "RW": False}]}]))
elif a[0] == "network":
    sys.exit(1)
"""


def test_a_fork_onto_new_containers_repeats_the_boxs_env(tmp_path):
    # A copy that restarts cold in a new container runs the agent's command again: it must get the
    # original's --env again, since nothing else of the caller's environment reaches it.
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER_FORK)
    fake.chmod(0o755)
    log = tmp_path / "docker.log"
    profile = tmp_path / "profile.json"
    profile.write_text((pathlib.Path(__file__).resolve().parents[2] / "profiles" / "default.json").read_text())
    (tmp_path / "b").mkdir()
    with WsBox(tmp_path / "b", ["sleep", "60"]) as box:
        env = dict(os.environ, SANDBOXER_DOCKER=str(fake), FAKE_DOCKER_LOG=str(log), FAKE_BOX_URL=box.url,
                   FAKE_PROFILE=str(profile), XDG_STATE_HOME=str(tmp_path / "xdg"))
        tok = ["--token-file", str(box.token_file)]
        snap = subprocess.run([str(CLI), "checkpoint", box.url, *tok], capture_output=True, text=True, timeout=60)
        assert snap.returncode == 0, snap.stderr
        snap = snap.stdout.strip().splitlines()[-1]
        f = subprocess.run([str(CLI), "fork", box.url, *tok, "--snapshot", snap, "-n", "1", "--host", "docker"],
                           capture_output=True, text=True, timeout=90, env=env)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 1, (f.stderr, runs)
    after_image = runs[0][runs[0].index("sha256:fake") + 1:]
    # The copy starts idle (the snapshot reaches it over its API), with the original's --env.
    assert "--idle" in after_image and after_image[after_image.index("--env") + 1] == "KEPT=1", after_image
    assert "--restore" not in after_image and not any("restore.tar.zst" in a for a in runs[0]), runs[0]
