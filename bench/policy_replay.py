"""Every eviction policy against Belady's OPT and the infinite-cache ideal on a real trace.

    python bench/policy_replay.py --json out/policy_replay.json

Replays the Mooncake conversation trace through the production prefix index and block
manager at 1%, 5%, 10% and 25% of its distinct blocks, one device tier. Prints hit
rates, the ratio of each policy's prefix hit rate to OPT's, and seconds per replay;
writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sage_infer.sim.replay import distinct_blocks, ideal_hit_rate, load_mooncake
from sage_infer.sim.tiered import all_policies, opt_rates, replay_device

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"


def run(requests: list, percents: list[float], policies: list[str]) -> list[dict]:
    distinct = distinct_blocks(requests)
    runs = []
    for percent in percents:
        capacity = max(1, round(distinct * percent / 100))
        start = time.perf_counter()
        opt, why = opt_rates(requests, capacity)
        opt_seconds = time.perf_counter() - start
        if opt is not None:
            opt["seconds"] = opt_seconds
        results = []
        for name in policies:
            start = time.perf_counter()
            result = replay_device(requests, name, capacity)
            seconds = time.perf_counter() - start
            ratio = result.prefix_hit_rate / opt["prefix_hit_rate"] if opt and opt["prefix_hit_rate"] else None
            results.append({"policy": name, "hit_rate": result.hit_rate, "prefix_hit_rate": result.prefix_hit_rate,
                            "ratio_to_opt_prefix": ratio, "seconds": seconds,
                            "us_per_access": result.us_per_access})
        runs.append({"percent": percent, "capacity_blocks": capacity, "opt": opt, "opt_missing": why,
                     "results": results})
    return runs


def print_table(runs: list[dict], ideal: float) -> None:
    print(f"{'capacity':>15} {'policy':>8} {'hit':>8} {'prefix':>8} {'/OPT':>6} {'s/replay':>9}")
    for r in runs:
        where = f"{r['percent']:g}% ({r['capacity_blocks']})"
        for x in r["results"]:
            ratio = "-" if x["ratio_to_opt_prefix"] is None else f"{x['ratio_to_opt_prefix']:.3f}"
            print(f"{where:>15} {x['policy']:>8} {x['hit_rate']:>8.2%} {x['prefix_hit_rate']:>8.2%} {ratio:>6} "
                  f"{x['seconds']:>9.2f}")
        opt = r["opt"]
        if opt:
            print(f"{where:>15} {'OPT':>8} {opt['hit_rate']:>8.2%} {opt['prefix_hit_rate']:>8.2%} {'1.000':>6} "
                  f"{opt['seconds']:>9.2f}")
        else:
            print(f"{where:>15} {'OPT':>8} {'n/a':>8} {'n/a':>8} {'-':>6} {'-':>9}  ({r['opt_missing']})")
    print(f"{'any':>15} {'ideal':>8} {ideal:>8.2%} {ideal:>8.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacities", default="1,5,10,25", help="Percents of the distinct blocks.")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.trace.exists():
        sys.exit(f"{args.trace}: trace not found (it ships in ../shared/traces beside the clone)")
    policies = all_policies()
    requests = load_mooncake(args.trace)[: args.max_requests]
    percents = [float(p) for p in args.capacities.split(",")]
    runs = run(requests, percents, policies)
    ideal = ideal_hit_rate(requests)
    print(f"{args.trace.name}: {len(requests)} requests, {sum(len(r.hash_ids) for r in requests)} block accesses, "
          f"{distinct_blocks(requests)} distinct")
    print_table(runs, ideal)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {"trace": str(args.trace), "requests": len(requests),
                    "accesses": sum(len(r.hash_ids) for r in requests), "distinct": distinct_blocks(requests),
                    "ideal_hit_rate": ideal, "policies": policies, "runs": runs,
                    "command": "python bench/policy_replay.py " + " ".join(sys.argv[1:])}
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
