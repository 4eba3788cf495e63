"""The journal: every byte of output, in order; UTF-8 or base64; durable across a SIGKILL."""
import base64
import hashlib
import json
import os
import signal
import subprocess
import time

from sbxtest import CLI, INIT, PROBE, WsBox, follow, read_journal, run, run_init


def spew_bytes(n):
    out = bytearray()
    line = 0
    while len(out) < n:
        out += b"%010d abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n" % line
        line += 1
    return bytes(out[:n])


def output_bytes(events, stream="stdout"):
    buf = bytearray()
    for e in events:
        if e["type"] == "proc.output" and e["stream"] == stream:
            buf += e["data"].encode() if "data" in e else base64.b64decode(e["data_b64"])
    return bytes(buf)


def assert_seq_complete(events):
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1))


def test_100mb_of_stdout_arrives_whole_and_in_order(tmp_path):
    n = 100 * 1024 * 1024
    r = run_init(["--", str(PROBE), "spew", str(n)], tmp_path / "s", timeout=240)
    assert r.returncode == 0, r.stderr
    events = read_journal(tmp_path / "s")
    assert_seq_complete(events)
    got = output_bytes(events)
    assert len(got) == n
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(spew_bytes(n)).hexdigest()
    # Sealed segments are zstd-compressed on disk.
    files = os.listdir(tmp_path / "s" / "journal")
    assert any(f.endswith(".jsonl.zst") for f in files), files


def test_invalid_utf8_round_trips_byte_exact(tmp_path):
    r = run_init(["--", str(PROBE), "badutf8"], tmp_path / "s")
    assert r.returncode == 0
    events = read_journal(tmp_path / "s")
    want = (b"ok \xff\xfe mid \xc3\x28 end\n" + b"split \xf0\x9f\x98\x80 done\n" + b"\xe2\x82")
    assert output_bytes(events) == want
    outs = [e for e in events if e["type"] == "proc.output"]
    # The split character was joined, so that chunk travels as text; bad bytes as base64.
    assert any(e.get("data") == "split " for e in outs) or any("split \U0001F600" in e.get("data", "") for e in outs)
    assert any("\U0001F600" in e.get("data", "") for e in outs)
    assert any("data_b64" in e for e in outs)


def test_c1_controls_in_output_reach_no_terminal_raw(tmp_path):
    # U+009B is ESC [ to a terminal that acts on C1 controls: JSON may carry it raw, and the journal
    # and `--events -` did, so an agent's "\u009b2J" cleared the screen of whoever `cat`s the
    # journal or watches --events. Each C1 control is written as its \u escape: the same text to
    # every parser (the bytes of the agent's output come back exact), no raw C2 80..C2 9F.
    out = "caf\u00e9 \u009b2J\u009d0;title\u0007 \u0085next\u00a0\n".encode()
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--events", "-", "--", "python3", "-c",
                        f"import sys; sys.stdout.buffer.write({out!r})"], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    segment = b"".join(p.read_bytes() for p in (tmp_path / "s" / "journal").glob("*.jsonl"))
    for text in (r.stdout, segment):
        raw_c1 = [i for i in range(len(text) - 1) if text[i] == 0xc2 and 0x80 <= text[i + 1] <= 0x9f]
        assert raw_c1 == [], text
        assert b"\\u009b2J" in text and b"\\u009d0;title" in text and b"\\u0085next" in text, text
        assert "\u00a0".encode() in text  # no control: as it is
    assert output_bytes(read_journal(tmp_path / "s")) == out
    assert output_bytes(json.loads(line) for line in r.stdout.splitlines()) == out


def test_json_lines_become_messages(tmp_path):
    script = 'echo \'{"step": 1, "note": "plan"}\'; echo "not json {"; echo \'[1,2]\'; echo \'{"step": 2}\''
    r = run_init(["--", "/bin/sh", "-c", script], tmp_path / "s")
    assert r.returncode == 0
    msgs = [e["message"] for e in read_journal(tmp_path / "s") if e["type"] == "proc.message"]
    assert msgs == [{"step": 1, "note": "plan"}, {"step": 2}]


def test_journal_reads_back_every_event_after_the_supervisor_is_gone(tmp_path):
    r = run_init(["--", "/bin/sh", "-c", "for i in $(seq 1 500); do echo line $i; done"], tmp_path / "s")
    assert r.returncode == 0
    events = read_journal(tmp_path / "s")
    assert_seq_complete(events)
    assert events[0]["type"] == "box.started" and events[-2]["type"] == "proc.exited"
    # The box's end is its last event: the agent's status, and why.
    assert events[-1]["type"] == "box.exited" and events[-1]["code"] == 0, events[-1]
    assert events[-1]["reason"] == "agent_exited", events[-1]
    assert all(e["box"] == events[0]["box"] and e["branch"] == "main" for e in events)
    text = output_bytes(events).decode()
    assert text == "".join(f"line {i}\n" for i in range(1, 501))
    # since: everything after N, nothing before.
    later = read_journal(tmp_path / "s", since=100)
    assert [e["seq"] for e in later] == list(range(101, len(events) + 1))


def test_sigkill_mid_stream_keeps_everything_written(tmp_path):
    state = tmp_path / "s"
    events_file = tmp_path / "events.jsonl"
    size = (1 << 34) + os.getpid()  # names this test's agent alone for the pkill below
    p = subprocess.Popen([str(INIT), "--state-dir", str(state), "--events", str(events_file), "--",
                          str(PROBE), "spew", str(size)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline and (not events_file.exists() or events_file.stat().st_size < 4 << 20):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    # The orphaned agent tree (its ns-init lost its supervisor) ends itself; make sure.
    subprocess.run(["pkill", "-KILL", "-f", f"{PROBE} spew {size}$"], check=False)
    seen = [json.loads(l) for l in events_file.read_text().splitlines() if l.endswith("}")]
    events = read_journal(state)
    assert_seq_complete(events)
    # Every event anyone saw is in the journal: it is written before it is shown.
    assert len(events) >= len(seen) - 1
    assert [e["seq"] for e in events[:len(seen) - 1]] == [e["seq"] for e in seen[:len(seen) - 1]]
    # A new supervisor on the same state dir recovers and continues the sequence.
    r = run_init(["--", "true"], state, as_pid1=False)
    assert r.returncode == 0
    after = read_journal(state)
    assert_seq_complete(after)
    assert after[len(events)]["type"] in ("journal.recovered", "box.started")
    assert all(e["box"] == events[0]["box"] for e in after)


def test_a_line_an_older_version_wrote_with_bytes_that_are_not_utf8_is_kept_and_read_as_text(tmp_path):
    # Before base::json_append wrote U+FFFD for such a byte, a message quoting a name the agent
    # chose (a checkpoint's failure) went into the journal as it was: the next start's recovery
    # dropped the line (a gap), and a reader that got it could not parse it.
    s = tmp_path / "s"
    assert run_init(["--", "true"], s).returncode == 0
    events = read_journal(s)
    last, box = events[-1]["seq"], events[0]["box"]
    seg = sorted((s / "journal").glob("*.jsonl"))[-1]
    with open(seg, "ab") as f:
        f.write(b'{"seq":%d,"ts":"2026-12-01T00:00:00.000000Z","type":"checkpoint.failed","box":"%s",'
                b'"error":{"code":"io","message":"write fs/tmp/caf\xe9: no"},"branch":"main"}\n'
                % (last + 1, box.encode()))
    # The box again in the same state dir: its segment changed since its clean end, so every line
    # is checked; this one is kept, and the new events follow it.
    assert run_init(["--", "true"], s).returncode == 0
    events = read_journal(s)
    assert_seq_complete(events)
    old = [e for e in events if e["seq"] == last + 1]
    assert old and old[0].get("error", {}).get("message") == "write fs/tmp/caf\ufffd: no", old
    assert events[-1]["seq"] > last + 2 and events[-2]["type"] == "proc.exited" and events[-1]["type"] == "box.exited"


def test_a_reader_of_events_that_stops_holds_nothing_up_and_gets_every_event_once(tmp_path):
    # `--events -` into a pipe nobody reads for a while (`sandboxer run ... | less`): the pipe
    # fills at 64 KiB, and a blocking write held the whole loop there: the API, signals, the
    # agent's output. Now the box goes on, the reader's backlog waits (4 MiB in memory, the rest
    # read back from the journal once it reads again), and it gets every event once, in order.
    import asyncio
    import secrets

    from sbxtest import ws_connect

    state, token = tmp_path / "s", tmp_path / "token"
    token.write_text(secrets.token_hex(16))
    agent = ("import os, sys, time\n"
             "for i in range(160000): sys.stdout.write('%07d ' % i + 'x' * 92 + '\\n')\n"
             "sys.stdout.flush()\n"
             "while not os.path.exists('/workspace/done'): time.sleep(0.05)\n")
    p = subprocess.Popen([str(INIT), "--state-dir", str(state), "--events", "-", "--listen", "127.0.0.1:0",
                          "--token-file", str(token), "--metrics-interval", "0", "--", "python3", "-c", agent],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = []
        while not first or first[-1]["type"] != "server.listening":
            first.append(json.loads(p.stdout.readline()))
        box = type("Box", (), {"url": f"ws://127.0.0.1:{first[-1]['port']}", "token": token.read_text()})
        # Reading nothing more, until the agent's 16 MB are in the journal.
        deadline = time.monotonic() + 60
        while not any("0159999 " in e.get("data", "") for e in read_journal(state)[-50:]):
            assert time.monotonic() < deadline and p.poll() is None, "the agent's output did not reach the journal"
            time.sleep(0.2)

        async def stats():
            async with ws_connect(box) as ws:
                await ws.send(json.dumps({"id": 1, "op": "stats"}))
                while (r := json.loads(await asyncio.wait_for(ws.recv(), 20))).get("id") != 1:
                    pass
                return r

        # The API answers meanwhile (before, its handshake waited for the reader).
        assert asyncio.run(stats())["ok"] is True
        (state / "branches/main/workspace/done").write_text("")
        rest = [json.loads(line) for line in p.stdout.read().splitlines()]
        assert p.wait(60) == 0, p.stderr.read()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    events = first + rest
    assert_seq_complete(events)
    assert events == read_journal(state)[: len(events)]
    lines = output_bytes(events).decode().splitlines()
    assert lines == ["%07d " % i + "x" * 92 for i in range(160000)]


def test_events_to_a_fifo_no_process_reads_is_refused_at_once(tmp_path):
    # Opening it waited for a reader, with every signal blocked: a TERM (a timeout, Ctrl-C) did
    # nothing, and only KILL ended it.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run_init(["--events", str(fifo), "--", "/bin/true"], tmp_path / "s", timeout=30)
    assert r.returncode == 125, r.stderr
    assert f"open --events {fifo}: a FIFO that no process reads (start its reader first)".encode() in r.stderr
    # With a reader, the same FIFO takes the events. The reader's end is opened here first: a `cat`
    # started beside the box had sometimes not opened it yet, and the box was refused as above.
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        r = run_init(["--events", str(fifo), "--", "/bin/echo", "through the fifo"], tmp_path / "s2", timeout=30)
        data = b""
        while chunk := os.read(rfd, 1 << 16):  # the box has ended: no writer, so b"" at the end
            data += chunk
        out = data.decode()
    finally:
        os.close(rfd)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["seq"] for line in out.splitlines()] == list(range(1, len(out.splitlines()) + 1))
    assert "through the fifo" in out


def damaged_sealed_segment(state):
    """A box's state dir whose journal holds three sealed, compressed segments and an active one,
    the second damaged on disk (the magic number of its first zstd frame zeroed): its events, the
    damaged segment's name, and the first and last seq it held."""
    r = run_init(["--", str(PROBE), "spew", str(40 << 20)], state, timeout=240)
    assert r.returncode == 0, r.stderr
    events = read_journal(state)
    assert_seq_complete(events)
    firsts = sorted(int(p.name.split(".")[0]) for p in (state / "journal").glob("*.jsonl.zst"))
    assert len(firsts) >= 2, os.listdir(state / "journal")
    name = "%020d.jsonl.zst" % firsts[1]
    with open(state / "journal" / name, "r+b") as f:
        f.write(b"\0\0\0\0")
    nxt = firsts[2] if len(firsts) > 2 else min(int(p.name.split(".")[0]) for p in (state / "journal").glob("*.jsonl"))
    return events, name, firsts[1], nxt - 1


def test_log_prints_the_events_after_a_compressed_segment_it_cannot_read(tmp_path):
    # Before, `sandboxer log DIR` printed nothing at all, said "read journal DIR/journal: Bad
    # message" without naming the segment, and exited 2: one damaged segment hid the whole journal.
    state = tmp_path / "s"
    events, name, first, last = damaged_sealed_segment(state)
    r = subprocess.run([str(CLI), "log", str(state), "--json"], capture_output=True, timeout=120)
    assert r.returncode == 1, r.stderr
    printed = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["seq"] for e in printed] == list(range(1, first)) + list(range(last + 1, events[-1]["seq"] + 1))
    assert printed == events[:first - 1] + events[last:]
    assert printed[-1]["type"] == "box.exited"
    assert r.stderr.decode() == (f"sandboxer log: {state}/journal: segment {name} cannot be read (Bad message): "
                                 f"seqs {first} to {last} skipped\n")
    # From a seq past it, nothing is missing: no word of it, and success.
    r = subprocess.run([str(CLI), "log", str(state), "--json", "--since", str(last)], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert [json.loads(line)["seq"] for line in r.stdout.splitlines()] == [e["seq"] for e in events[last:]]


def test_a_box_starts_again_where_its_newest_segment_is_compressed_and_cannot_be_read(tmp_path):
    # A box that ended right after a seal leaves its newest segment compressed. Damaged on disk (the
    # magic number of its first frame zeroed), it stopped the next start: "open journal: Bad message".
    state = tmp_path / "s"
    r = run_init(["--", str(PROBE), "spew", str(40 << 20)], state, timeout=240)
    assert r.returncode == 0, r.stderr
    journal = state / "journal"
    actives = list(journal.glob("*.jsonl"))
    last = min(int(p.name.split(".")[0]) for p in actives) - 1  # the newest sealed segment's last seq
    for active in actives:
        active.unlink()
    newest = max(journal.glob("*.jsonl.zst"))
    with open(newest, "r+b") as f:
        f.write(b"\0\0\0\0")
    r = run_init(["--", "/bin/true"], state)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(CLI), "log", str(state), "--json", "--since", str(last)], capture_output=True,
                       timeout=60)
    after = [json.loads(line) for line in r.stdout.splitlines()]
    # The sequence goes on after the last line the segment held (its last frame still decodes).
    assert after[0]["seq"] == last + 1 and after[0]["type"] == "journal.recovered", after[:2]
    assert after[0]["segment"] == newest.name.split(".")[0] and after[0]["unreadable"] == "Bad message"
    assert after[0]["last_seq_known"] is True and after[0]["last_seq"] == last and after[0]["branch"] == "main"
    assert after[1]["type"] == "box.started" and after[-1]["type"] == "box.exited"


def test_a_replay_over_the_api_goes_past_a_compressed_segment_it_cannot_read(tmp_path):
    # Before, the client got `replay_failed` (id null) and its subscription ended there.
    events, name, first, last = damaged_sealed_segment(tmp_path / "state")
    with WsBox(tmp_path, ["/bin/sleep", "60"]) as box:
        started = box.wait_event(lambda e: e["type"] == "proc.started")
        got = run(follow(box, lambda e: e["seq"] >= started["seq"]), timeout=120)
        # The events before the segment, one event in place of what it held, and every one after.
        gap = [e for e in got if e["type"] == "journal.unreadable"]
        assert len(gap) == 1, gap
        assert gap[0]["seq"] == last and gap[0]["first_seq"] == first and gap[0]["last_seq"] == last, gap
        assert gap[0]["segment"] == name and gap[0]["error"] == "Bad message" and gap[0]["box"] == events[0]["box"]
        assert gap[0]["branch"] == "main"
        assert [e["seq"] for e in got] == list(range(1, first)) + list(range(last, started["seq"] + 1))
        assert [e for e in got if e["seq"] < first or last < e["seq"] <= events[-1]["seq"]] == \
            events[:first - 1] + events[last:]
        # `sandboxer log URL` says it as it says a local journal's, and prints the rest.
        r = subprocess.run([str(CLI), "log", box.url, "--json", "--token-file", str(box.token_file)],
                           capture_output=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert r.stderr.decode() == (f"sandboxer log: {box.url}: segment {name} cannot be read (Bad message): "
                                     f"seqs {first} to {last} skipped\n")
        seqs = [json.loads(line)["seq"] for line in r.stdout.splitlines()]
        assert seqs[:first - 1] == list(range(1, first)) and seqs[first - 1] == last + 1
