"""`sandboxer log URL`: a box's journal replayed over the API, printed as `log STATE_DIR` prints it."""
import json
import subprocess
import time

import pytest

from sbxtest import CLI, WsBox

AGENT = ["sh", "-c", "for i in 1 2 3; do echo line$i; done; sleep 120"]


@pytest.fixture
def box(tmp_path):
    with WsBox(tmp_path, AGENT, extra=["--set", "resources.grace=1s"]) as b:
        b.wait_event(lambda e: e.get("type") == "proc.output" and "line3" in e.get("data", ""))
        yield b


def log(*args, timeout=60):
    return subprocess.run([str(CLI), "log", *args], capture_output=True, timeout=timeout)


def test_log_of_a_url_prints_what_log_of_the_state_dir_prints(box):
    for fmt in ([], ["--json"]):
        remote = log(box.url, "--token-file", str(box.token_file), *fmt)
        assert remote.returncode == 0, remote.stderr
        local = log(str(box.state), *fmt)
        assert local.returncode == 0, local.stderr
        # The replay ends at the last seq the box had when asked; the local read, later, may have more.
        r, l = remote.stdout.decode().splitlines(), local.stdout.decode().splitlines()
        assert r and r == l[:len(r)]
        assert "line3" in remote.stdout.decode()
    seqs = [json.loads(x)["seq"] for x in log(box.url, "--token-file", str(box.token_file), "--json").stdout.splitlines()]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] == 1


def test_log_of_a_url_since_n_starts_after_n(box):
    remote = log(box.url, "--token-file", str(box.token_file), "--json", "--since", "3")
    assert remote.returncode == 0, remote.stderr
    seqs = [json.loads(x)["seq"] for x in remote.stdout.splitlines()]
    local = [json.loads(x)["seq"] for x in log(str(box.state), "--json", "--since", "3").stdout.splitlines()]
    assert seqs and seqs[0] == 4 and seqs == local[:len(seqs)]
    # Past the end: nothing, and it returns at once rather than waiting.
    r = log(box.url, "--token-file", str(box.token_file), "--since", "100000")
    assert r.returncode == 0 and r.stdout == b""


def exec_and_read_up_to_it(box, p):
    """Runs `echo after-the-replay` in the box; the --json lines `p` prints, up to its output."""
    ex = subprocess.run([str(CLI), "exec", "--token-file", str(box.token_file), box.url, "--",
                         "echo", "after-the-replay"], capture_output=True, timeout=60)
    assert ex.returncode == 0, ex.stderr
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(json.loads(line))
        if "after-the-replay" in seen[-1].get("data", ""):
            break
    return seen


def test_log_follow_of_a_url_goes_on_with_new_events(box):
    p = subprocess.Popen([str(CLI), "log", box.url, "--token-file", str(box.token_file), "--json", "--follow"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = exec_and_read_up_to_it(box, p)
        assert any("line1" in e.get("data", "") for e in seen)
        assert "after-the-replay" in seen[-1].get("data", ""), seen[-3:]
        assert p.poll() is None  # still following
    finally:
        p.kill()
        p.wait(10)


def test_log_follow_ends_cleanly_when_the_box_ends(box):
    p = subprocess.Popen([str(CLI), "log", box.url, "--token-file", str(box.token_file), "--follow"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(0.5)
    box.stop()
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert b"line3" in out


def test_log_of_a_url_with_a_wrong_token_fails_with_the_reason(box, tmp_path):
    bad = tmp_path / "bad-token"
    bad.write_text("0" * 32 + "\n")
    bad.chmod(0o600)
    r = log(box.url, "--token-file", str(bad))
    assert r.returncode == 1 and b"sandboxer log" in r.stderr and b"unauthorized" in r.stderr, r.stderr
    assert box.alive()


@pytest.mark.parametrize("given", ["state dir", "journal dir"])
def test_log_follow_of_a_state_dir_goes_on_while_its_box_runs_and_ends_with_it(box, given):
    # Once a usage error ("--follow needs a URL"): a local box without --listen had no way to be
    # followed. Its journal is read again while the box's supervisor holds the state dir's lock.
    where = box.state if given == "state dir" else box.state / "journal"
    p = subprocess.Popen([str(CLI), "log", str(where), "--json", "--follow"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        seen = exec_and_read_up_to_it(box, p)
        assert "after-the-replay" in seen[-1].get("data", ""), seen[-3:]
        assert p.poll() is None  # still following
        box.stop()
        # Through the same buffered reader as above (communicate() reads the fd past its buffer).
        out = p.stdout.read()
        assert p.wait(timeout=30) == 0, p.stderr.read()
        seen += [json.loads(l) for l in out.splitlines()]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    # Every event once, in order, to the box's last.
    assert [e["seq"] for e in seen] == list(range(1, len(seen) + 1)), [(e["seq"], e["type"]) for e in seen]
    assert seen[-1]["type"] == "box.exited" and seen[-1]["reason"] == "shutdown", seen[-3:]
    # A box that has ended: what its journal holds, and the end at once.
    r = log(str(where), "--follow", "--json", timeout=10)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == len(seen), r.stderr


def test_log_of_a_directory_that_holds_no_journal_says_so(box, tmp_path):
    # A mistyped state dir (here one holding a stray .jsonl, as /tmp does) printed nothing and
    # exited 0. The control: the state dir and its journal dir print the same lines.
    stray = tmp_path / "not-a-box"
    stray.mkdir()
    (stray / "rows.jsonl").write_text('{"seq": 1}\n')
    r = log(str(stray))
    assert r.returncode != 0 and r.stdout == b"", r
    assert b"not a box's state dir nor its journal" in r.stderr, r.stderr
    whole, journal = log(str(box.state), "--json"), log(str(box.state / "journal"), "--json")
    assert whole.returncode == 0 and journal.returncode == 0, (whole.stderr, journal.stderr)
    n = len(journal.stdout.splitlines())
    assert n >= 3 and whole.stdout.splitlines()[:n] == journal.stdout.splitlines()
