"""Ceiling of a class-based retention policy on a Mooncake trace (an analysis, not a policy).

Groups requests into conversations (a request continues an earlier one when it matches
all of that prompt's blocks but its last, partial one), classes each request (by turn,
turn x previous gap, or turn x prompt length), and gives every class the fixed retention
time T that is best *in hindsight*, subject to the average number of cached blocks
(block-seconds / trace duration) fitting the capacity. Hits = blocks of a next turn that
arrives within T. This is a continuous-time approximation of a cache (it ignores the
order of evictions), used to ask: how much could an online policy that knows these
features, and tunes to this very trace, get at most?

    .venv/bin/python bench/policy_ceiling.py ../shared/traces/mooncake/conversation_trace.jsonl --by turn
"""

from __future__ import annotations

import argparse
import collections
import json
import math

GRID = [0, 10, 20, 30, 45, 60, 90, 120, 150, 200, 250, 300, 400, 500, 700, 1000, 1500, 2000, 3000]


def conversations(rows):
    seen, last_req_of = set(), {}
    turn, nxt, prv = [0] * len(rows), [None] * len(rows), [None] * len(rows)
    for i, r in enumerate(rows):
        ids = r["hash_ids"]
        hit = 0
        while hit < len(ids) and ids[hit] in seen:
            hit += 1
        if hit > 1:
            j = last_req_of[ids[hit - 1]]
            if hit >= len(rows[j]["hash_ids"]) - 1:
                turn[i], prv[i] = turn[j] + 1, j
                if nxt[j] is None:
                    nxt[j] = i
        for h in ids:
            seen.add(h)
            last_req_of[h] = i
    return turn, nxt, prv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--by", choices=("turn", "gap", "len"), default="turn")
    ap.add_argument("--capacity", default="1,5,10", help="percent of distinct blocks, comma list")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.trace)]
    turn, nxt, prv = conversations(rows)
    duration = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    accesses = sum(len(r["hash_ids"]) for r in rows)
    distinct = len({h for r in rows for h in r["hash_ids"]})
    items = collections.defaultdict(list)
    for i, r in enumerate(rows):
        length = len(r["hash_ids"]) - 1  # the partial last block is never reused
        gap = (rows[nxt[i]]["timestamp"] - r["timestamp"]) / 1000 if nxt[i] is not None else None
        if args.by == "turn":
            key = min(turn[i], 5)
        elif args.by == "gap":
            prev_gap = (r["timestamp"] - rows[prv[i]]["timestamp"]) / 1000 if prv[i] is not None else None
            key = (0,) if prev_gap is None else (min(turn[i], 3), min(int(math.log2(prev_gap / 30 + 1)), 4))
        else:
            key = (min(turn[i], 3), min(length // 16, 3))
        items[key].append((length, gap))

    def evaluate(key, t):
        hits = occupancy = 0
        for length, gap in items[key]:
            if gap is not None and gap <= t:
                hits += length
                occupancy += length * gap
            else:
                occupancy += length * t
        return hits, occupancy / duration

    keys = sorted(items)
    table = {k: [evaluate(k, t) for t in GRID] for k in keys}

    def total(idx):
        return (sum(table[k][i][0] for k, i in zip(keys, idx)), sum(table[k][i][1] for k, i in zip(keys, idx)))

    for pct in (float(p) for p in args.capacity.split(",")):
        capacity = round(distinct * pct / 100)
        best = (0, None)
        for start in range(len(GRID)):  # pairwise coordinate ascent from every uniform start
            idx = [start] * len(keys)
            if total(idx)[1] > capacity:
                continue
            improved = True
            while improved:
                improved, current = False, total(idx)[0]
                for a in range(len(keys)):
                    for na in range(len(GRID)):
                        for b in range(len(keys)):
                            for nb in range(len(GRID)):
                                trial = list(idx)
                                trial[a], trial[b] = na, nb
                                hits, occupancy = total(trial)
                                if occupancy <= capacity and hits > current:
                                    idx, current, improved = trial, hits, True
            hits = total(idx)[0]
            if hits > best[0]:
                best = (hits, {str(k): GRID[i] for k, i in zip(keys, idx)})
        # + one first-block hit per request (the shared system-prompt block every policy keeps)
        rate = (best[0] + len(rows)) / accesses * 100
        print(f"{pct:g}% ({capacity} blocks): ceiling {rate:.2f}% with retention seconds {best[1]}")


if __name__ == "__main__":
    main()
