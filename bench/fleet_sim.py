"""The fleet bench's customers workload through the fleet replay: every routing policy at every load, no machine.

`bench/fleet.py` runs real replicas, whose numbers move with the machine; this runs the same
experiment through `sim.fleet.replay_fleet` — simulated replicas, each the engine's own KV
manager with an LRU device cache, computing the blocks they miss at `--prefill-tok-s` one
request after another, behind the router's own `Router` — so a routing change can be judged
on numbers that do not depend on the machine's load. C customers (a context of
`--context-blocks` trace blocks each, 512 tokens a block) send one-block queries at Poisson
rates; each replica caches `--capacity` blocks. Per policy and load: TTFT p50/p90 (queueing +
computing, no decoding), the prefix hit rate, the kv router's prediction error (|predicted -
found| / found blocks) and the load balance; then each policy's goodput (the highest load whose
TTFT p90 meets `--slo-s`) and, at each load, its TTFT p90 as a multiple of round-robin's.

    python bench/fleet_sim.py --customers 6 --zipf 1.0 --rates 2,3,4,5,6,7,8 --out out/fleet_sim.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

from sage_infer.kv_policy.routing import ROUTING_POLICIES  # noqa: E402
from sage_infer.sim.customers import customers_trace  # noqa: E402
from sage_infer.sim.fleet import replay_fleet  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    rates = [float(r) for r in args.rates.split(",")]
    routings = [r for r in args.routings.split(",") if r]
    rows = []
    for rate in rates:
        for routing in routings:
            runs = [replay_fleet(customers_trace(args.customers, args.context_blocks, rate, args.duration_s,
                                                 args.zipf, seed), routing, args.replicas, args.capacity,
                                 args.policy, prefill_tokens_per_s=args.prefill_tok_s, seed=seed).to_json()
                    for seed in range(args.seeds)]
            rows.append({"rate": rate, "routing": routing, **{
                key: statistics.median(run[key] for run in runs)
                for key in ("prefix_hit_rate", "prediction_error", "compute_imbalance")},
                "ttft_p50_s": statistics.median(run["ttft_s"]["p50"] for run in runs),
                "ttft_p90_s": statistics.median(run["ttft_s"]["p90"] for run in runs)})
    goodput = {routing: max([row["rate"] for row in rows if row["routing"] == routing
                             and row["ttft_p90_s"] <= args.slo_s], default=0.0) for routing in routings}
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows,
            "goodput": goodput}


def print_table(result: dict) -> None:
    rows = result["rows"]
    baseline = {row["rate"]: row["ttft_p90_s"] for row in rows if row["routing"] == "round-robin"}
    print(f"{'rate':>5} {'routing':<12} {'p50 s':>8} {'p90 s':>8} {'p90 / rr':>9} {'hit':>6} {'pred err':>9} "
          f"{'imbalance':>9}")
    for row in rows:
        rr = baseline.get(row["rate"])
        ratio = f"{row['ttft_p90_s'] / rr:9.2f}" if rr else f"{'-':>9}"
        print(f"{row['rate']:5g} {row['routing']:<12} {row['ttft_p50_s']:8.2f} {row['ttft_p90_s']:8.2f} {ratio} "
              f"{row['prefix_hit_rate']:6.3f} {row['prediction_error']:9.3f} {row['compute_imbalance']:9.2f}")
    slo = result["args"]["slo_s"]
    rr = result["goodput"].get("round-robin")
    for routing, rate in result["goodput"].items():
        ratio = f" ({rate / rr:.2f} x round-robin)" if rr else ""
        print(f"goodput at TTFT p90 <= {slo:g} s: {routing} {rate:g} req/s{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routings", default=",".join(ROUTING_POLICIES))
    parser.add_argument("--customers", type=int, default=6)
    parser.add_argument("--zipf", type=float, default=1.0, help="customer popularity skew (0: uniform)")
    parser.add_argument("--context-blocks", type=int, default=4, help="trace blocks (512 tokens) per context")
    parser.add_argument("--capacity", type=int, default=9, help="device blocks per replica")
    parser.add_argument("--prefill-tok-s", type=float, default=4000.0)
    parser.add_argument("--policy", default="lru", help="each replica's device eviction policy (kv_policy)")
    parser.add_argument("--rates", default="2,3,4,5,6,7,8", help="requests per second, comma-separated")
    parser.add_argument("--duration-s", type=float, default=120.0, help="of arrivals per load")
    parser.add_argument("--seeds", type=int, default=3, help="runs per point (medians are reported)")
    parser.add_argument("--slo-s", type=float, default=1.5)
    parser.add_argument("--out", type=Path, default=Path("out/fleet_sim.json"))
    args = parser.parse_args()
    if "round-robin" not in args.routings.split(","):
        parser.error("--routings must include round-robin (the baseline of the ratios)")
    result = run(args)
    print_table(result)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
