"""Each example runs, under the real supervisor."""
import subprocess

from sbxtest import CLI, ROOT, read_journal


def test_primes(tmp_path):
    state = tmp_path / "s"
    r = subprocess.run([str(CLI), "run", "--state-dir", str(state), "--", "python3",
                        str(ROOT / "examples/primes/agent.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main exited, code 0 (exited)" in r.stdout
    msgs = [e["message"] for e in read_journal(state) if e["type"] == "proc.message"]
    steps = [m["step"] for m in msgs]
    assert steps[0] == "plan" and steps[-1] == "report"
    # The first draft fails the check, the second passes.
    checks = [m for m in msgs if m["step"] == "check"]
    assert [c["ok"] for c in checks] == [False, True]
    report = msgs[-1]
    assert report["primes"][:5] == [2, 3, 5, 7, 11] and report["last"] == 229 and len(report["primes"]) == 50
    # The script it wrote is in its workspace, kept in the state dir.
    assert (state / "branches/main/workspace/primes.py").exists()


def test_long_horizon(tmp_path):
    """Left running with an idle limit: it ends with reason idle; detached clients lose nothing
    (the journal has every round); its metrics draw a plot."""
    import os
    state = tmp_path / "s"
    # The agent's environment is clean: its settings go in with --env (ROUNDS by name, from ours).
    env = dict(os.environ, ROUNDS="6")
    r = subprocess.run([str(CLI), "run", "--state-dir", str(state), "--json", "--env", "ROUNDS", "--env", "ROUND_SECONDS=0.3",
                        "--set", "resources.idle=2s", "--set", "resources.timeout=60s",
                        "--set", "metrics.interval=200ms", "--",
                        "python3", str(ROOT / "examples/long-horizon/agent.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    events = read_journal(state)
    ex = [e for e in events if e["type"] == "proc.exited"]
    assert ex and ex[-1]["reason"] == "idle", ex
    rounds = [e["message"]["round"] for e in events if e["type"] == "proc.message" and e["message"]["step"] == "round"]
    assert rounds == list(range(1, 7))
    assert len([e for e in events if e["type"] == "metrics"]) >= 5
    svg = tmp_path / "lh.svg"
    p = subprocess.run(["python3", str(ROOT / "examples/long-horizon/plot.py"), str(state), str(svg)],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, SANDBOXER_CLI=str(CLI)))
    assert p.returncode == 0, p.stderr
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<polyline") == 2


def walk_through(tmp_path, port):
    """README's walk-through, its commands as README has them, each made to run here: the CLI of
    this build, a free port, a state dir under tmp_path, the repository for $PWD."""
    block = (ROOT / "README.md").read_text().split("## A five-minute walk-through", 1)[1].split("\n## ", 1)[0]
    lines = []
    for line in block.splitlines():
        line = line.strip()
        if line.startswith(("./build/bin/sandboxer", "S=$(")):
            line = line.split("   #", 1)[0].strip()  # the comment beside it
            for a, b in (("./build/bin/sandboxer", str(CLI)), ("127.0.0.1:7000", f"127.0.0.1:{port}"),
                         ("/tmp/primes-box", str(tmp_path / "primes-box")), ("$PWD", str(ROOT))):
                line = line.replace(a, b)
            lines.append(line)
    return lines


def follow_until(argv, env, text):
    """A follower (attach) read until a line holds `text`, then Ctrl-C: it leaves quietly."""
    import signal
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        while not seen or text not in seen[-1]:
            line = p.stdout.readline()
            assert line, ("".join(seen), p.stderr.read())
            seen.append(line)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 0 and err == "", (p.returncode, err)
        return "".join(seen)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def in_a_terminal(argv, env, typed):
    """Runs argv with a pty as its terminal, types `typed`, and returns what the terminal showed."""
    import os
    import pty
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    os.write(master, typed.encode())
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the other side has closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert p.wait(timeout=30) == 0, shown
    return shown.decode(errors="replace")


def test_the_readme_walk_through(tmp_path):
    """README's five-minute walk-through, command by command, as a newcomer types it: each works
    (its agent ended at once before --stay, and every command after `run` found no box)."""
    import os
    import re
    import shlex
    from sbxtest import free_port_pair
    port = free_port_pair()
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    env.pop("SANDBOXER_TOKEN", None)
    lines = walk_through(tmp_path, port)
    assert len(lines) == 12, lines
    state = tmp_path / "primes-box"
    box = subprocess.Popen(shlex.split(lines[0]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert "serving" in box.stderr.readline() or "serving" in box.stderr.readline()
        snapshot = None
        for line in lines[1:]:
            argv = shlex.split(line)
            sub = argv[1] if argv[0] == str(CLI) else "checkpoint"
            if sub == "attach" and "--branch" not in argv:
                assert '"step": "report"' in follow_until(argv, env, '"step": "stay"')
            elif sub == "attach":
                follow_until(argv, env, "restore.done")
            elif "-it" in argv:
                shown = in_a_terminal(argv, env, "echo walk-$((6*7)); exit\n")
                assert "walk-42" in shown, shown
            elif line.startswith("S=$("):
                r = subprocess.run(["bash", "-c", line + '; echo "$S"'], capture_output=True, text=True, env=env,
                                   timeout=120)
                snapshot = r.stdout.strip().splitlines()[-1]
                assert r.returncode == 0 and re.fullmatch(r"s-[0-9a-f]+", snapshot), r
            else:
                argv = [snapshot if a == "$S" else a for a in argv]
                r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
                assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
                if sub == "exec":
                    assert "primes.py" in r.stdout
                elif sub == "cp":
                    assert (tmp_path / "primes.py").read_bytes() == \
                        (state / "branches/main/workspace/primes.py").read_bytes()
                elif sub == "stats":
                    assert "memory" in r.stdout
                elif sub == "fork":
                    assert sorted(l.split()[0] for l in r.stdout.splitlines()) == ["f1", "f2", "f3", "f4"], r.stdout
                elif sub == "down" and "--rm" not in argv:
                    assert box.wait(timeout=60) == 0
                elif sub == "log":
                    assert '"step": "report"' in r.stdout and "main exited, code 0" in r.stdout, r.stdout
        assert not state.exists()  # down --rm
    finally:
        if box.poll() is None:
            box.kill()
            box.wait()
