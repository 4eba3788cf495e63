#!/usr/bin/env python3
"""A fork-and-explore agent: an expensive prefix, then N copies of itself, one strategy each.

The problem is a travelling salesman tour through --cities random cities. The prefix builds the
distance matrix and a start tour (nearest neighbour, then 2-opt until no move helps): seconds of
work, held in memory only. At that decision point the agent asks its supervisor, through the
agent channel (sdk/python's `sandboxer.agent`; never the box token), to checkpoint it and start
N copies. Each copy learns who it is from the channel (branch, index) and tries one strategy on
the start tour: simulated annealing with its own seed and start temperature, for a fixed number
of moves. Each step is one JSON line on stdout (a `proc.message` event in the box's journal);
a copy's result line is what the driver (`run`) gathers from the copy's event stream.

What shows that a copy continued from the prefix instead of redoing it: before the fork the agent
prints `state` (SHA-256 of its distance matrix and start tour) and `nonce` (16 random bytes that
are only ever in memory); every copy prints both again, computed from its own memory, with
`prefix_s` 0.

Without live checkpoint (no criu, no namespaces, or a dump that fails) the supervisor's fork is a
cold restart: the agent's command runs again on the checkpoint's files with SANDBOXER_RESUMED=1.
Memory is gone, so such a copy says so (`continued: false`), redoes the prefix from the problem's
seed (written to the workspace before the fork), and still tries its own strategy. Its `state`
matches (the prefix is deterministic), its `nonce` does not.

The original stays after the fork (it holds nothing the copies need) until the driver shuts the
box down, or --wait seconds pass.

usage: agent.py [--cities N] [--moves M] [--copies K] [--wait S]
(arguments, not environment variables: a box on another host does not inherit the caller's
environment, and a cold restart re-runs this same command line)
"""
import argparse
import array
import hashlib
import json
import math
import os
import pathlib
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sandboxer_agent as channel_module  # noqa: E402  (sdk/python/sandboxer/agent.py, uploaded beside this file)

WORKSPACE = pathlib.Path(os.environ.get("SANDBOXER_WORKSPACE", os.getcwd()))
PROBLEM = WORKSPACE / "problem.json"
ARGS = argparse.Namespace()
HEAT = [0.1, 0.3, 1.0, 3.0]  # copy i (0, 1, ...): seed i, start temperature HEAT[i % 4] x the mean edge


def say(step, **fields):
    print(json.dumps({"step": step, **fields}), flush=True)


RESTORED = {}


@channel_module.on_restore
def on_restore(identity):
    """Runs in each live copy as it starts, before its fork() returns. A copy's memory is its
    parent's, generators included: sandboxer.agent has just reseeded `random` from the kernel, so
    what is drawn from it now is this copy's own (`salt`, which differs between copies). A real
    agent reopens its connections here (a copy's TCP connections were closed at its restore)."""
    RESTORED.update(branch=identity.get("branch"), salt=random.getrandbits(32))


# ---- the prefix: deterministic for a given seed ----

def make_problem(seed, n):
    rng = random.Random(seed)
    pts = [(rng.uniform(0, 1000), rng.uniform(0, 1000)) for _ in range(n)]
    dist = array.array("d", (math.dist(a, b) for a in pts for b in pts))
    return dist


def tour_length(dist, n, tour):
    return sum(dist[tour[i - 1] * n + tour[i]] for i in range(n))


def nearest_neighbour(dist, n):
    tour, seen = [0], {0}
    while len(tour) < n:
        row = tour[-1] * n
        nxt = min((c for c in range(n) if c not in seen), key=lambda c: dist[row + c])
        tour.append(nxt)
        seen.add(nxt)
    return tour


def two_opt(dist, n, tour):
    """First-improvement 2-opt: apply any improving reversal until none is left."""
    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            a, b = tour[i], tour[i + 1]
            ab = dist[a * n + b]
            for j in range(i + 2, n if i else n - 1):
                c, d = tour[j], tour[(j + 1) % n]
                delta = dist[a * n + c] + dist[b * n + d] - ab - dist[c * n + d]
                if delta < -1e-9:
                    tour[i + 1:j + 1] = reversed(tour[i + 1:j + 1])
                    improved = True
                    b = tour[i + 1]
                    ab = dist[a * n + b]
    return tour


def prefix(seed, n):
    t0 = time.monotonic()
    dist = make_problem(seed, n)
    tour = two_opt(dist, n, nearest_neighbour(dist, n))
    return dist, tour, neighbours(dist, n), time.monotonic() - t0


def state_sum(dist, tour):
    return hashlib.sha256(dist.tobytes() + array.array("i", tour).tobytes()).hexdigest()


# ---- one strategy: simulated annealing on 2-opt moves ----

def neighbours(dist, n, k=8):
    """The k nearest cities of each city: 2-opt moves that join near cities are the ones worth trying."""
    return [sorted((c for c in range(n) if c != a), key=lambda c: dist[a * n + c])[:k] for a in range(n)]


def anneal(dist, near, n, start, seed, t0, moves):
    rng = random.Random(seed)
    tour = list(start)
    pos = [0] * n
    for p, c in enumerate(tour):
        pos[c] = p
    cur = best = tour_length(dist, n, tour)
    best_tour = list(tour)
    temp = t0
    cool = (0.01 / t0) ** (1.0 / moves)  # geometric, down to 0.01 at the end
    accepted = 0
    for _ in range(moves):
        temp *= cool
        # Make city a's successor one of a's near cities c: reverse the path between them.
        i = rng.randrange(n)
        j = pos[rng.choice(near[tour[i]])]
        if i > j:
            i, j = j, i
        if j - i < 2 or (i == 0 and j == n - 1):
            continue
        a, b, c, d = tour[i], tour[i + 1], tour[j], tour[(j + 1) % n]
        delta = dist[a * n + c] + dist[b * n + d] - dist[a * n + b] - dist[c * n + d]
        if delta < 0 or rng.random() < math.exp(-delta / temp):
            tour[i + 1:j + 1] = reversed(tour[i + 1:j + 1])
            for p in range(i + 1, j + 1):
                pos[tour[p]] = p
            cur += delta
            accepted += 1
            if cur < best - 1e-9:
                best, best_tour = cur, list(tour)
    return tour_length(dist, n, best_tour), best_tour, accepted


def explore(dist, tour, near, nonce, who, continued, prefix_s):
    """This copy's one strategy, and its result line."""
    index = int(who.get("index") or 0)
    seed = index
    heat = HEAT[index % len(HEAT)]
    n = len(tour)
    temp = heat * tour_length(dist, n, tour) / n
    try:
        branch_json = channel_module.branch_info()  # the same identity, from the copy's own files
    except OSError:
        branch_json = None  # no root of its own (flat mode): no /run/sandboxer of its own either
    say("continue", branch=who.get("branch"), index=index, mode=who.get("mode"), continued=continued,
        state=state_sum(dist, tour), nonce=nonce, prefix_s=round(prefix_s, 3), branch_json=branch_json,
        salt=RESTORED.get("salt"))
    start_len = tour_length(dist, n, tour)
    t0 = time.monotonic()
    length, best, accepted = anneal(dist, near, n, tour, seed, temp, ARGS.moves)
    assert sorted(best) == list(range(n))  # still a tour through every city once
    say("result", branch=who.get("branch"), index=index, mode=who.get("mode"), continued=continued,
        strategy={"seed": seed, "heat": heat, "moves": ARGS.moves}, start=round(start_len, 3),
        length=round(length, 3), accepted=accepted, search_s=round(time.monotonic() - t0, 3),
        prefix_s=round(prefix_s, 3), state=state_sum(dist, tour), nonce=nonce)


def wait_for_shutdown():
    signal.signal(signal.SIGTERM, lambda *_: (say("stopped"), sys.exit(0)))
    say("waiting", seconds=ARGS.wait)
    time.sleep(ARGS.wait)
    say("gave_up_waiting")


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--cities", type=int, default=800)
    ap.add_argument("--moves", type=int, default=300000, help="moves each copy tries")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--wait", type=float, default=600, help="seconds the original waits for the shutdown")
    ARGS = ap.parse_args()
    ch = channel_module.Channel()
    if os.environ.get("SANDBOXER_RESUMED") == "1":
        # A cold restart on the checkpoint's files: nothing of the prefix is in memory.
        who = ch.whoami()
        problem = json.loads(PROBLEM.read_text())
        say("cold_restart", branch=who["branch"], index=who["index"], snapshot=os.environ.get("SANDBOXER_SNAPSHOT"),
            note="no live checkpoint: memory was not kept, redoing the prefix from the problem's seed")
        dist, tour, near, took = prefix(problem["seed"], problem["cities"])
        explore(dist, tour, near, None, who, False, took)
        return

    seed = int.from_bytes(os.urandom(4), "little")
    PROBLEM.write_text(json.dumps({"seed": seed, "cities": ARGS.cities}) + "\n")
    nonce = os.urandom(16).hex()  # in memory only: never written anywhere but stdout
    dist, tour, near, took = prefix(seed, ARGS.cities)
    say("prefix", cities=ARGS.cities, seed=seed, start=round(tour_length(dist, ARGS.cities, tour), 3),
        prefix_s=round(took, 3), state=state_sum(dist, tour), nonce=nonce)

    # The decision point: checkpoint here and go on in --copies copies, one strategy each.
    try:
        r = ch.fork(ARGS.copies, name="decision")
    except channel_module.ChannelError as e:
        # Said, not hidden: the driver shows it (and the copies that did start, if any).
        say("fork_failed", code=e.code, message=e.message)
        wait_for_shutdown()
        return
    if r.get("copy"):
        who = dict(ch.identity or {}, branch=r["branch"], index=r["index"], mode=r.get("mode", "live"))
        explore(dist, tour, near, nonce, who, True, 0.0)
        return
    say("forked", snapshot=r.get("snapshot"), copies=r.get("copies"))
    wait_for_shutdown()


if __name__ == "__main__":
    main()
