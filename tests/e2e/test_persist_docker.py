"""Agents that outlive their container (issue 16): `sandboxer up` with a profile that persists
keeps the state dir on the host and sets a restart policy; `docker stop` + `docker start` and
`docker kill` + `docker start` and `docker restart` come back to the live agent, and `sandboxer down` ends it for good.
The private dockerd and the image are tests/e2e/conftest.py's."""
import os

import pytest

from test_docker import COUNTER, E2E, Up, cli, docker, ticks, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dockerd and images/build need root")


def resumed_after(box, seen):
    """Waits for the box.resumed of the next run and three ticks after it; returns (event, ticks)."""
    events = wait_for(box, "the agent resumes", lambda ev: any(e["type"] == "box.resumed" for e in ev[seen:])
                      and len(ticks(ev[seen:], "main")) >= 3, timeout=90)
    (ev,) = [e for e in events[seen:] if e["type"] == "box.resumed"]
    return ev, ticks(events[seen:], "main")


@pytest.mark.timeout(300)
def test_docker_stop_start_and_kill_start_come_back_to_the_live_agent(docker_env, image):
    box = Up(docker_env, image, COUNTER, "-v", f"{E2E}:/opt/e2e:ro", "--set", "checkpoint.every=2s", "--set",
             "checkpoint.on_stop=true")
    with box:
        assert box.inspect()["HostConfig"]["RestartPolicy"]["Name"] == "on-failure"
        wait_for(box, "a periodic snapshot", lambda ev: any(e["type"] == "checkpoint.created" for e in ev))

        # docker stop: SIGTERM, the on_stop checkpoint ends the agent, the container exits 0.
        docker(docker_env, "stop", box.name, timeout=60)
        assert box.inspect()["State"]["ExitCode"] == 0
        before = box.journal()
        assert [e["name"] for e in before if e["type"] == "checkpoint.created"][-1] == "on_stop"
        last = ticks(before, "main")[-1]
        docker(docker_env, "start", box.name)
        ev, after = resumed_after(box, len(before))
        assert ev["mode"] == "live" and ev["name"] == "on_stop"
        # Nothing lost (a line in the stdout pipe at the dump may come again from the restored pipe).
        assert after[0]["nonce"] == last["nonce"] and after[0]["n"] in (last["n"], last["n"] + 1)

        # docker kill: no grace; the newest periodic snapshot comes back.
        wait_for(box, "a periodic snapshot after the resume",
                 lambda ev: any(e["type"] == "checkpoint.created" and e["seq"] > before[-1]["seq"] for e in ev))
        docker(docker_env, "kill", box.name)
        killed = box.journal()
        docker(docker_env, "start", box.name)
        ev, again = resumed_after(box, len(killed))
        assert ev["mode"] == "live" and ev["name"] == "periodic" and ev["lost"]["ms"] >= 0
        assert again[0]["nonce"] == last["nonce"] and again[0]["n"] <= ticks(killed, "main")[-1]["n"] + 1
        assert again[0]["n"] > last["n"] + 1  # from a snapshot taken after the first resume

        # docker restart: stop (on_stop's checkpoint) and start in one.
        restarted = box.journal()
        docker(docker_env, "restart", box.name, timeout=60)
        ev, third = resumed_after(box, len(restarted))
        assert ev["mode"] == "live" and ev["name"] == "on_stop" and third[0]["nonce"] == last["nonce"]
        assert third[0]["n"] >= ticks(restarted, "main")[-1]["n"]

        # down: stopped and removed for good; the journal stays, the snapshots go.
        r = cli(docker_env, "down", box.name, timeout=120)
        assert r.returncode == 0, r.stderr
        assert docker(docker_env, "inspect", box.name, check=False).returncode != 0
        assert (box.state / "journal").is_dir() and not (box.state / "snapshots").exists()
