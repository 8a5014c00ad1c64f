"""A fleet of replicas behind each routing policy, side by side: llm-d's precise-prefix experiment in miniature.

C customers, each with a long context of its own (a system prompt, documents) that all its
requests share, and short queries; Poisson arrivals from light load to past saturation. The fleet
is `sage llm serve --replicas N --routing R` (one core per replica on a 2-core machine; `--launcher ray`: Ray actors
of one CPU each) with a
device KV per replica well below the customers' working set, so where a customer's requests go
decides whether its context is computed once or over and over. Each policy runs the same
requests (same seed) at each load; the script prints, per policy and load, TTFT p50/p90/p99, the
fleet's prefix hit rate (cached / prompt tokens, from the replicas' usage), how the requests were
spread over the replicas, the router's prediction error (predicted vs reported cached tokens)
and its own latency per request (p99 from its histogram), then each policy's goodput (the
highest load whose TTFT p90 meets the SLO with no error) and its ratio to round-robin's.
`vllm-<routing>` runs N vLLM-CPU servers behind sage's router instead: `vllm-round-robin` is what
users run today, `vllm-kv` routes them by the KV events they publish on ZMQ. `vllm-dp-<routing>`
runs one vLLM server with N data-parallel ranks: `vllm-dp-round-robin` leaves the rank to vLLM's
own balancer, `vllm-dp-kv` has sage's router pick it by each rank's events.

    python bench/fleet.py --model qwen3-11m --customers 4 --context-len 2048 --rates 1,2,4,6,8 --out out/fleet.json

Writes JSON (and a PNG of TTFT p90 against load with --plot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from multiturn_vs_vllm import REPO, Server, free_port, goodput  # noqa: E402
from vllm_models import MODELS, model_facts, prepare_model  # noqa: E402

from sage_infer.kv_policy.routing import ROUTING_POLICIES  # noqa: E402
from sage_infer.serving_bench.runner import run_workload  # noqa: E402
from sage_infer.serving_bench.stats import percentile  # noqa: E402
from sage_infer.serving_bench.workloads import BenchRequest, Workload, poisson_arrivals, random_token_ids  # noqa: E402

READY = re.compile(r"at (http://\S+)/v1 \((\d+) replicas")
COUNTERS = ("sage:router_predicted_cached_tokens_total", "sage:router_reported_cached_tokens_total",
            "sage:router_cached_tokens_abs_error_total", "sage:router_overhead_seconds_count",
            "sage:router_overhead_seconds_sum",
            "sage:router_retries_total", "sage:router_prefix_moves_total")


def customers_workload(args: argparse.Namespace, vocab: int, rate: float, seed: int,
                       duration_s: float) -> tuple[Workload, list[float]]:
    """`rate * duration_s` one-turn requests, each of a customer drawn uniformly (or, with --zipf S, customer k with
    weight 1 / (k + 1)^S: a few hot customers, as real tenants are): its context, then a fresh query."""
    rng = random.Random(seed)
    contexts = [random_token_ids(rng, args.context_len, vocab) for _ in range(args.customers)]
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.customers)]
    n = max(4, round(rate * duration_s))
    requests = []
    for i in range(n):
        customer = rng.choices(range(args.customers), weights)[0]
        query = random_token_ids(rng, args.query_len, vocab)
        requests.append([BenchRequest([contexts[customer], query], args.context_len + args.query_len,
                                      args.output_len, conversation=i)])
    return Workload("customers", requests), poisson_arrivals(n, rate, seed + 1)


class VllmFleet:
    """N vLLM-CPU servers, each on its own core with sage's per-replica KV budget, behind `sage llm router --replica
    ... --routing R`: under round-robin what users run today (replicas behind a plain balancer); under kv each server
    publishes its KV events on ZMQ (loopback ipc sockets) and the router routes by them. The router's URL once all
    serve."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, routing: str, log: Path) -> None:
        self.args, self.model_dir, self.routing, self.log_path = args, model_dir, routing, log
        kv_bytes = args.kv_blocks * args.block_size * model_kv_bytes_per_token(model_dir, args.dtype)
        python = str(REPO / args.vllm_venv / "bin" / "python")
        self.servers, self.replica_flags = [], []
        if routing.startswith("dp-"):  # one server, its ranks one per core
            self.routing = routing.removeprefix("dp-")
            self._data_parallel(python, kv_bytes, log)
            return
        for core in range(args.replicas):
            port = free_port()
            env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)}
            command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
                       "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", "--dtype",
                       {"fp32": "float32", "bf16": "bfloat16"}[args.dtype], "--max-model-len", "4096",
                       "--kv-cache-memory-bytes", str(kv_bytes)]
            flag = f"http://127.0.0.1:{port}"
            if routing == "kv":
                events = f"ipc://{log.parent.resolve()}/{log.stem}-{core}"
                command += ["--kv-events-config", json.dumps({
                    "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"{events}.events",
                    "replay_endpoint": f"{events}.replay"})]
                flag += f",events={events}.events,replay={events}.replay"
            self.servers.append(Server(f"vllm-{core}", command, env, log.with_name(f"{log.stem}-{core}.log"), port))
            self.replica_flags.append(flag)

    def _data_parallel(self, python: str, kv_bytes: int, log: Path) -> None:
        """One vLLM server with --data-parallel-size N (a rank per core, each with the per-replica KV budget): behind
        round-robin its own balancer picks the rank (what vLLM users run); behind kv sage's router picks it from each
        rank's events (`dp=N`)."""
        args, port = self.args, free_port()
        events, replay = free_port(), free_port()
        while abs(replay - events) < args.replicas:
            replay = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(core) for core in range(args.replicas))}
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir), "--host",
                   "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", "--dtype",
                   {"fp32": "float32", "bf16": "bfloat16"}[args.dtype], "--max-model-len", "4096",
                   "--kv-cache-memory-bytes", str(kv_bytes), "--data-parallel-size", str(args.replicas)]
        flag = f"http://127.0.0.1:{port}"
        if self.routing == "kv":
            command += ["--kv-events-config", json.dumps({  # vLLM binds a "*" endpoint (and connects any other)
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}"})]
            flag += f",events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay},dp={args.replicas}"
        self.servers.append(Server("vllm-dp", command, env, log.with_name(f"{log.stem}-dp.log"), port))
        self.replica_flags.append(flag)

    def __enter__(self) -> VllmFleet:
        for server in self.servers:  # one at a time: each compiles its model at start on a shared machine
            server.__enter__()
        self.router_port = free_port()
        command = [sys.executable, "-m", "sage_infer.cli.main", "llm", "router", "--routing", self.routing, "--port",
                   str(self.router_port)]
        for flag in self.replica_flags:
            command += ["--replica", flag]
        self.router = Server("router", command, dict(os.environ), self.log_path, self.router_port).__enter__()
        self.url = self.router.url
        return self

    def __exit__(self, *exc) -> None:
        self.router.__exit__(*exc)
        for server in self.servers:
            server.__exit__(*exc)


def model_kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * (4 if dtype == "fp32" else 2)


class Fleet:
    """`sage llm serve --replicas N --routing R` as a subprocess; its URL once it serves."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, routing: str, log: Path) -> None:
        self.command = [sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--model", str(model_dir),
                        "--replicas", str(args.replicas), "--routing", routing, "--port", "0",
                        "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
                        "--set", f"kv_pool.num_blocks={args.kv_blocks}", "--block-size", str(args.block_size),
                        "--launcher", args.launcher]
        self.log_path = log

    def __enter__(self) -> Fleet:
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        match = READY.search(line)
        if match is None:
            raise RuntimeError(f"the fleet did not start ({line!r}); see {self.log_path}")
        self.url, self.ready_line = match.group(1), line
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def router_metrics(url: str) -> dict[str, float]:
    """The router's counters: routed per replica, prediction sums, and its overhead histogram's buckets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "sage:router_requests_total":
                out[f"routed {sample.labels['instance']}"] = sample.value
            elif sample.name in COUNTERS:
                out[sample.name] = sample.value
            elif sample.name == "sage:router_overhead_seconds_bucket":
                out[f"le {sample.labels['le']}"] = sample.value
    return out


def overhead_p99_ms(before: dict, after: dict) -> float | None:
    """The upper bound of the histogram bucket holding the 99th percentile of this load's router overhead."""
    total = after.get("sage:router_overhead_seconds_count", 0) - before.get("sage:router_overhead_seconds_count", 0)
    if total <= 0:
        return None
    bounds = sorted((float(k[3:]), after[k] - before.get(k, 0)) for k in after if k.startswith("le "))
    for bound, count in bounds:
        if count >= 0.99 * total:
            return bound * 1000 if math.isfinite(bound) else None
    return None


def measure(args: argparse.Namespace, fleet: Fleet, vocab: int, rate: float, seed: int, duration_s: float) -> dict:
    workload, arrivals = customers_workload(args, vocab, rate, seed, duration_s)
    before = router_metrics(fleet.url)
    run = asyncio.run(run_workload(fleet.url, None, None, workload, arrivals, concurrency=256))
    after = router_metrics(fleet.url)
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    reported = delta.get("sage:router_reported_cached_tokens_total", 0)
    routed = sorted(v for k, v in delta.items() if k.startswith("routed "))
    return {
        "rate": rate, "requests": len(run.results), "errors": len(run.results) - len(ok),
        "errors_seen": sorted({r.error for r in run.results if not r.ok})[:3],
        "ttft_ms": {q: percentile(ttft, p) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
        "hit_rate": cached / prompt if prompt else None,
        "routed_per_replica": routed,
        "imbalance": max(routed) / (sum(routed) / len(routed)) if routed and sum(routed) else None,
        "prediction_error": delta.get("sage:router_cached_tokens_abs_error_total", 0) / reported if reported else None,
        "router_overhead_p99_ms": overhead_p99_ms(before, after),
        "prefix_moves": delta.get("sage:router_prefix_moves_total", 0),
        "duration_s": run.duration_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routings", default=",".join(ROUTING_POLICIES),
                        help="sage fleets; vllm-<routing> (e.g. vllm-round-robin): vLLM-CPU servers behind sage's "
                        "router (vllm-kv: routed by the KV events they publish on ZMQ); vllm-dp-<routing>: one vLLM "
                        "server with --data-parallel-size N (vllm-dp-round-robin: its own balancer picks the rank; "
                        "vllm-dp-kv: sage's router picks it by each rank's events)")
    parser.add_argument("--launcher", default="local", choices=("local", "ray"),
                        help="sage's replicas as processes pinned to core shares, or as Ray actors (a local Ray "
                        "instance started by the command)")
    parser.add_argument("--vllm-venv", default=".vllm-venv")
    parser.add_argument("--customers", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=0.0, help="customer popularity skew (0: uniform)")
    parser.add_argument("--context-len", type=int, default=2048)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=288, help="device KV blocks per replica")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rates", default="1,2,4,6,8", help="requests per second, comma-separated")
    parser.add_argument("--duration-s", type=float, default=30.0, help="of arrivals per load")
    parser.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path("out/models"))
    parser.add_argument("--out", type=Path, default=Path("out/fleet.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    routings = args.routings.split(",")
    for routing in routings:
        if routing.removeprefix("vllm-").removeprefix("dp-") not in ROUTING_POLICIES:
            parser.error(f"--routings: {routing!r} is not one of {', '.join(ROUTING_POLICIES)} (or vllm-<one>)")
    rates = [float(r) for r in args.rates.split(",")]
    model_dir = prepare_model(MODELS[args.model], args.cache_dir)
    facts = model_facts(model_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    working_set = args.customers * args.context_len
    print(f"{args.model} {args.dtype}, {args.replicas} replicas x {args.kv_blocks * args.block_size} device KV tokens "
          f"(fleet {args.replicas * args.kv_blocks * args.block_size}) for {args.customers} customers x "
          f"{args.context_len} context tokens ({working_set}, popularity zipf {args.zipf:g}); "
          f"query {args.query_len}, output {args.output_len}; "
          f"loads {rates} req/s for {args.duration_s:g} s each; TTFT SLO p90 <= {args.slo_ttft_ms:g} ms")
    results: dict[str, list[dict]] = {}
    for routing in routings:
        kind = VllmFleet if routing.startswith("vllm-") else Fleet
        with kind(args, model_dir, routing.removeprefix("vllm-"), args.out.with_name(f"fleet-{routing}.log")) as fleet:
            measure(args, fleet, facts["vocab_size"], 1.0, args.seed, 4.0)  # warm-up: its contexts are not reused
            rows = results[routing] = []
            for i, rate in enumerate(rates, 1):
                # every load draws fresh contexts (no load inherits another's cache); each policy gets the same ones
                row = measure(args, fleet, facts["vocab_size"], rate, args.seed + 1000 * i, args.duration_s)
                rows.append(row)
                t = row["ttft_ms"]
                print(f"{routing:<12} {rate:>5g} req/s  TTFT p50/p90/p99 "
                      f"{_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} ms"
                      f"  hit {_pct(row['hit_rate'])}  spread {row['routed_per_replica']}"
                      f"  moves {row['prefix_moves']:g}  pred.err "
                      f"{_pct(row['prediction_error'])}  router p99 {_f(row['router_overhead_p99_ms'], '.1f')} ms"
                      f"  errors {row['errors']} {row['errors_seen'] or ''}", flush=True)
        time.sleep(1)
    summary = {routing: goodput(rows, args.slo_ttft_ms) for routing, rows in results.items()}
    base, vllm = summary.get("round-robin"), summary.get("vllm-round-robin")
    for routing, g in summary.items():
        ratio = f"  ({g / base:.2f}x round-robin)" if g and base else ""
        ratio += f"  ({g / vllm:.2f}x vLLM behind round-robin)" if g and vllm else ""
        print(f"goodput {routing:<18} {'-' if g is None else format(g, 'g')} req/s{ratio}")
    at_saturation = saturation_ratios(results, args.slo_ttft_ms)
    if at_saturation:
        print(f"at {at_saturation['rate']:g} req/s, the lowest load where round-robin misses the SLO: TTFT p90 "
              + ", ".join(f"{r} {x:.2f}x" for r, x in at_saturation["p90_vs_round_robin"].items()) + " round-robin's")
    write_json(args.out, {"config": vars(args) | {"out": str(args.out), "cache_dir": str(args.cache_dir),
                                                  "plot": str(args.plot)},
                          "model": facts, "results": results, "goodput": summary, "at_saturation": at_saturation})
    if args.plot is not None:
        plot(args.plot, results, args.slo_ttft_ms)


def saturation_ratios(results: dict[str, list[dict]], slo_ms: float) -> dict | None:
    """Each routing's TTFT p90 ÷ round-robin's at the lowest load where round-robin's p90 misses the SLO (None
    without round-robin, or when it never misses)."""
    base = {row["rate"]: row["ttft_ms"]["p90"] for row in results.get("round-robin", [])}
    missed = [rate for rate, p90 in sorted(base.items()) if p90 is not None and p90 > slo_ms]
    if not missed:
        return None
    rate = missed[0]
    ratios = {routing: row["ttft_ms"]["p90"] / base[rate] for routing, rows in results.items() for row in rows
              if row["rate"] == rate and row["ttft_ms"]["p90"] is not None}
    return {"rate": rate, "p90_vs_round_robin": ratios}


def plot(path: Path, results: dict[str, list[dict]], slo_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for routing, rows in results.items():
        ax.plot([r["rate"] for r in rows], [r["ttft_ms"]["p90"] for r in rows], marker="o", label=routing)
    ax.axhline(slo_ms, color="grey", linestyle="--", label="SLO")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("TTFT p90 (ms)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _f(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


if __name__ == "__main__":
    main()
