"""The broker's lookups through the system's resolver run side by side: a name whose DNS server
is slow does not hold the answer to another name behind it.

The box runs in a mount namespace of its own where /etc/resolv.conf names a DNS server of this
test on a loopback address (127.0.0.77:53), which answers `fast.example.test` at once and
`slow.example.test` after two seconds. The agent asks the broker (its only DNS) for the slow name,
then the fast one, over UDP, and records which answer came first."""
import json
import pathlib
import socket
import struct
import subprocess
import threading
import time

import pytest

from sbxtest import INIT, clean_env, read_journal

DNS_ADDR = "127.0.0.77"
ANSWER = "192.0.2.7"  # TEST-NET-1: allowed by the profile below, reached by no one
SLOW_S = 2.0

AGENT = r'''
import json, socket, struct, time
def query(i, name):
    q = struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(10)
t0 = time.monotonic()
s.sendto(query(1, "slow.example.test"), ("127.0.0.1", 53))
time.sleep(0.2)  # the slow lookup is under way first
s.sendto(query(2, "fast.example.test"), ("127.0.0.1", 53))
got = []
for _ in range(2):
    data, _ = s.recvfrom(512)
    (qid, flags) = struct.unpack(">HH", data[:4])
    got.append({"id": qid, "rcode": flags & 0xF, "answers": struct.unpack(">H", data[6:8])[0],
                "s": round(time.monotonic() - t0, 3)})
print(json.dumps({"order": got}), flush=True)
'''


class SlowDns:
    """A DNS server on DNS_ADDR:53: an A record for every name, after SLOW_S for names that start
    with `slow`; AAAA and other questions get an empty NOERROR."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((DNS_ADDR, 53))
        self.asked = []
        self.stop = False
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while not self.stop:
            try:
                msg, peer = self.sock.recvfrom(512)
            except OSError:
                return
            threading.Thread(target=self.answer, args=(msg, peer), daemon=True).start()

    def answer(self, msg, peer):
        pos, labels = 12, []
        while msg[pos]:
            labels.append(msg[pos + 1:pos + 1 + msg[pos]].decode())
            pos += 1 + msg[pos]
        qtype = struct.unpack(">H", msg[pos + 1:pos + 3])[0]
        name = ".".join(labels)
        self.asked.append((name, qtype, time.monotonic()))
        if name.startswith("slow"):
            time.sleep(SLOW_S)
        question = msg[12:pos + 5]
        if qtype == 1:
            rr = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(ANSWER)
            reply = msg[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question + rr
        else:
            reply = msg[:2] + struct.pack(">HHHHH", 0x8180, 1, 0, 0, 0) + question
        try:
            self.sock.sendto(reply, peer)
        except OSError:
            pass

    def close(self):
        self.stop = True
        self.sock.close()


@pytest.fixture
def slow_dns():
    try:
        d = SlowDns()
    except OSError as e:
        pytest.skip(f"cannot serve DNS on {DNS_ADDR}:53: {e}")
    yield d
    d.close()


def test_a_slow_name_does_not_hold_another_names_answer(tmp_path, slow_dns):
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {DNS_ADDR}\noptions timeout:5 attempts:1\n")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"name": "dns-test", "network": {
        "mode": "proxy", "allow": ["slow.example.test", "fast.example.test"], "allow_cidrs": [ANSWER]}}))
    state = tmp_path / "s"
    ws = state / "branches" / "main" / "workspace"
    ws.mkdir(parents=True)
    (ws / "agent.py").write_text(AGENT)
    # The supervisor (and so the broker) sees this test's resolv.conf; nothing else changes.
    cmd = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c",
           'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv),
           str(INIT), "--state-dir", str(state), "--profile", str(profile), "--", "python3", "/workspace/agent.py"]
    r = subprocess.run(cmd, capture_output=True, timeout=60, env=clean_env())
    events = read_journal(state)
    lines = [e["message"] for e in events if e["type"] == "proc.message" and "order" in e["message"]]
    assert r.returncode == 0 and lines, (r.stderr.decode()[-2000:],
                                         [e for e in events if e["type"] in ("proc.output", "policy.denied")])
    order = lines[0]["order"]
    # Both were answered, with the address the server gave (allowed by allow_cidrs).
    assert sorted(o["id"] for o in order) == [1, 2] and all(o["rcode"] == 0 and o["answers"] == 1 for o in order), order
    # The slow name was asked of the server first (the broker had it before the fast one) ...
    asked = [n for n, qtype, _ in slow_dns.asked if qtype == 1]
    assert asked.index("slow.example.test") < asked.index("fast.example.test"), slow_dns.asked
    # ... and still the fast name's answer came first: it did not wait behind the slow lookup.
    assert [o["id"] for o in order] == [2, 1], order
