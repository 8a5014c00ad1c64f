"""A replica SIGKILLed under load: what the fleet loses and how fast its goodput comes back.

`sage llm serve --replicas N --routing R` (bench/fleet.py's fleet and customers) under a steady Poisson load;
`--kill-at-s` seconds in, replica-0 is SIGKILLed (the process listening on its port). The command starts it
again at the same URL and the router takes it back when its event stream answers. The script reports, for the
windows before the kill, while the replica is away, and after it is back: requests sent, those that failed before
their first token (the router should retry them elsewhere: the goal is none), those cut mid-stream (ended with an
error event, as they must be), TTFT p50/p90 and completed requests per second. JSON with every request's times.

    python bench/fleet_failover.py --rate 3 --duration-s 60 --kill-at-s 20 --out out/fleet_failover.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from fleet import Fleet, customers_workload  # noqa: E402
from vllm_models import MODELS, model_facts, prepare_model  # noqa: E402

from sage_infer.hal.net import listening_pid  # noqa: E402
from sage_infer.serving_bench.runner import run_workload  # noqa: E402
from sage_infer.serving_bench.stats import percentile  # noqa: E402

REPLICA = re.compile(r"replica-(\d+) (http://[^,)\s]+)")


class Killer(threading.Thread):
    """SIGKILLs the replica at `url` `after_s` seconds from `start`, then notes when it answers /health again."""

    def __init__(self, url: str, after_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.after_s = url, after_s
        self.start_time = 0.0
        self.killed_s: float | None = None
        self.back_s: float | None = None

    def run(self) -> None:
        time.sleep(self.after_s)
        pid = listening_pid(int(self.url.rsplit(":", 1)[1]))
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        self.killed_s = time.perf_counter() - self.start_time
        time.sleep(0.5)
        while self.back_s is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.back_s = time.perf_counter() - self.start_time
            except httpx.HTTPError:
                time.sleep(0.2)


def window(results, start: float, end: float) -> dict:
    """The requests sent in [start, end) seconds."""
    sent = [r for r in results if start <= r.start_s < end]
    ok = [r for r in sent if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    return {"from_s": round(start, 1), "to_s": round(end, 1), "sent": len(sent), "completed": len(ok),
            "failed_before_first_token": sum(1 for r in sent if not r.ok and r.ttft_s is None),
            "cut_mid_stream": sum(1 for r in sent if not r.ok and r.ttft_s is not None),
            "errors_seen": sorted({r.error for r in sent if not r.ok})[:3],
            "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90)},
            "completed_per_s": len(ok) / (end - start) if end > start else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routing", default="kv")
    parser.add_argument("--customers", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=0.0)
    parser.add_argument("--context-len", type=int, default=2048)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=288)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--kill-at-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path("out/models"))
    parser.add_argument("--out", type=Path, default=Path("out/fleet_failover.json"))
    args = parser.parse_args()
    model_dir = prepare_model(MODELS[args.model], args.cache_dir)
    vocab = model_facts(model_dir)["vocab_size"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with Fleet(args, model_dir, args.routing, args.out.with_name("fleet-failover.log")) as fleet:
        replicas = dict(REPLICA.findall(fleet.ready_line))
        workload, arrivals = customers_workload(args, vocab, args.rate, args.seed, args.duration_s)
        killer = Killer(replicas["0"], args.kill_at_s)
        killer.start_time = time.perf_counter()
        killer.start()
        run = asyncio.run(run_workload(fleet.url, None, None, workload, arrivals, concurrency=256))
        killer.join(timeout=120)
    end = max(r.start_s for r in run.results) + 1e-3
    killed, back = killer.killed_s or end, killer.back_s or end
    windows = {"before the kill": window(run.results, 0.0, killed),
               "replica away": window(run.results, killed, back),
               "after it is back": window(run.results, back, end)}
    print(f"{args.replicas} replicas, routing {args.routing}, {args.rate:g} req/s; replica-0 SIGKILLed at "
          f"{killer.killed_s and round(killer.killed_s, 1)} s, back at {killer.back_s and round(killer.back_s, 1)} s")
    for name, w in windows.items():
        print(f"{name:<17} sent {w['sent']:>4}  completed {w['completed']:>4}  failed before first token "
              f"{w['failed_before_first_token']}  cut mid-stream {w['cut_mid_stream']}  TTFT p50/p90 "
              f"{w['ttft_ms']['p50'] or 0:.0f}/{w['ttft_ms']['p90'] or 0:.0f} ms  "
              f"{w['completed_per_s'] or 0:.2f} req/s {w['errors_seen'] or ''}")
    write_json(args.out, {"config": vars(args) | {"out": str(args.out), "cache_dir": str(args.cache_dir)},
                          "killed_s": killer.killed_s, "back_s": killer.back_s, "windows": windows,
                          "requests": [{"start_s": r.start_s, "ttft_s": r.ttft_s, "error": r.error}
                                       for r in run.results]})


if __name__ == "__main__":
    main()
