# An agent for the persistence tests: a nonce made at start and kept only in memory, and a counter,
# printed as one JSON line per tick. A live resume goes on with the same nonce from the counter the
# snapshot froze; a cold start would print a new nonce and count from 1.
# usage: persist_agent.py TICK_S [QUIET_AT SLEEP_S [END]]: after tick QUIET_AT it sleeps SLEEP_S
# (no output: the idle limit can end it), and it exits 0 after tick END.
import json
import os
import sys
import time

tick = float(sys.argv[1])
quiet_at = int(sys.argv[2]) if len(sys.argv) > 2 else 0
sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0
end = int(sys.argv[4]) if len(sys.argv) > 4 else 0
nonce = os.urandom(8).hex()
n = 0
while True:
    n += 1
    print(json.dumps({"n": n, "nonce": nonce}), flush=True)
    if n == end:
        sys.exit(0)
    time.sleep(sleep_s if n == quiet_at else tick)
