# An agent for the persistence tests: a nonce made at start and kept only in memory, and a counter,
# printed as one JSON line per tick. A live resume goes on with the same nonce from the counter the
# snapshot froze; a cold start would print a new nonce and count from 1.
# usage: persist_agent.py TICK_S [QUIET_AT SLEEP_S [END]]: after tick QUIET_AT it sleeps SLEEP_S
# (no output: the idle limit can end it), and it exits 0 after tick END. With PERSIST_NAMED_AT=N in
# its environment, it asks for a checkpoint named "mine" on its agent channel at tick N.
import json
import os
import sys
import time

tick = float(sys.argv[1])
quiet_at = int(sys.argv[2]) if len(sys.argv) > 2 else 0
sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0
end = int(sys.argv[4]) if len(sys.argv) > 4 else 0
named_at = int(os.environ.get("PERSIST_NAMED_AT", "0"))
nonce = os.urandom(8).hex()


def checkpoint_named_mine():
    req, rep = (int(fd) for fd in os.environ["SANDBOXER_CHANNEL_FD"].split(","))
    os.write(req, b'{"id":1,"op":"checkpoint","name":"mine"}\n')
    reply = b""
    while not reply.endswith(b"\n"):
        reply += os.read(rep, 4096)
    assert json.loads(reply)["ok"], reply



n = 0
while True:
    n += 1
    print(json.dumps({"n": n, "nonce": nonce}), flush=True)
    if n == named_at:
        checkpoint_named_mine()
    if n == end:
        sys.exit(0)
    time.sleep(sleep_s if n == quiet_at else tick)
