"""The fleet router's own time per request, with kv routing: tokenizing and hashing in the router against asking a
replica for the prompt's hashes, side by side over the same two replicas.

Two `sage llm serve` replicas (the bundled demo model unless --model) and, in turn, a router in front of them with
the served model's tokenizer (`sage llm router --tokenizer DIR`: it renders the chat template and tokenizes
itself) and one without (it asks the least busy replica, ``POST /v1/kv/hashes``). The client sends chat requests
one at a time (a long shared system prompt per customer, a short question, 1 token out), so the router's time is
its own and not queueing behind the replicas' work; the router's ``sage:router_overhead_seconds`` histogram (body
read to the call to the chosen replica) gives the mean and the bucket holding the 99th percentile, and the
client's round trip is printed next to it.

    python bench/router_overhead.py --requests 200 --out out/router_overhead.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from fleet import overhead_p99_ms, router_metrics  # noqa: E402
from multiturn_vs_vllm import REPO, Server, free_port  # noqa: E402

from sage_infer.models.loader import resolve_model_dir  # noqa: E402
from sage_infer.serving_bench.stats import percentile  # noqa: E402


def run_mode(args: argparse.Namespace, replicas: list[str], model_dir: Path, local: bool, log: Path) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "sage_infer.cli.main", "llm", "router", "--port", str(port),
               *[flag for url in replicas for flag in ("--replica", url)],
               *(["--tokenizer", str(model_dir)] if local else [])]
    with Server("router", command, None, log, port) as router:
        time.sleep(2.0)  # its event streams connect and take the replicas' snapshots
        model = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
        system = [" ".join(f"customer{c} fact{i}" for i in range(args.context_words)) for c in range(args.customers)]
        round_trips = []
        for i in range(args.requests):
            body = {"model": model, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "system", "content": system[i % args.customers]},
                                 {"role": "user", "content": f"question {i}?"}]}
            started = time.perf_counter()
            reply = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
            round_trips.append((time.perf_counter() - started) * 1000)
            assert reply.status_code == 200, reply.text
        hist = router_metrics(router.url)
    count, total = hist.get("sage:router_overhead_seconds_count", 0), hist.get("sage:router_overhead_seconds_sum", 0)
    return {"mode": "router tokenizes" if local else "asks a replica", "requests": args.requests,
            "overhead_mean_ms": total / count * 1000 if count else None,
            "overhead_p99_bucket_ms": overhead_p99_ms({}, hist),
            "round_trip_ms": {q: percentile(round_trips, p) for q, p in (("p50", 50), ("p99", 99))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled demo model)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--customers", type=int, default=4)
    parser.add_argument("--context-words", type=int, default=60, help="of each customer's system prompt")
    parser.add_argument("--out", type=Path, default=Path("out/router_overhead.json"))
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    logs = REPO / "out" / "router_overhead"
    logs.mkdir(parents=True, exist_ok=True)
    ports = [free_port(), free_port()]
    servers = [Server(f"replica-{i}", [sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--port",
                                       str(port), *(["--model", str(model_dir)] if args.model else [])],
                      None, logs / f"replica-{i}.log", port) for i, port in enumerate(ports)]
    with servers[0] as a, servers[1] as b:
        rows = [run_mode(args, [a.url, b.url], model_dir, local, logs / f"router-{local}.log")
                for local in (True, False)]
    print(f"{'mode':<18} {'overhead mean':>14} {'p99 bucket':>11} {'round trip p50 / p99':>22}")
    for row in rows:
        mean, p99 = row["overhead_mean_ms"], row["overhead_p99_bucket_ms"]
        bound = f"≤ {p99:.1f} ms" if p99 else "-"
        print(f"{row['mode']:<18} {mean:>11.2f} ms {bound:>11} "
              f"{row['round_trip_ms']['p50']:>9.1f} / {row['round_trip_ms']['p99']:.1f} ms")
    ask, local = rows[1]["overhead_mean_ms"], rows[0]["overhead_mean_ms"]
    print(f"asking a replica costs {ask / local:.1f} x the router's own tokenizing" if local else "")
    write_json(args.out, {"bench": "router_overhead", "model": str(model_dir), "customers": args.customers,
                          "context_words": args.context_words, "results": rows})


if __name__ == "__main__":
    main()
