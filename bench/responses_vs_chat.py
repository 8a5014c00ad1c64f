"""Agent sessions continued by `previous_response_id` (`/v1/responses`, the server keeps the session and retains its
KV) against the same sessions resent in full over chat completions, while other traffic passes through a small
device pool and evicts whatever is idle. JSON out.

One `sage llm serve` (the demo model unless --model, a --num-blocks device pool); per run, `sage llm bench
--workload random` (prompts of --noise-len tokens, 1 output token, --noise-concurrency in flight) runs in the
background for the length of one `sage llm bench --workload agent --api chat|responses` run. The runs alternate
chat, responses, chat, ... (--rounds of each), every run with its own seed, so no run finds another's sessions in
the cache, each on a fresh server (nothing cached or retained from the run before). Per run, over steps 2 and
later: TTFT p50 / p90, the share of the previous step's context (its prompt and answer, in full blocks) that
the server reported as cached, and the prompt tokens it computed per step; the medians over runs, and the median
of responses ÷ chat over rounds.

    .venv/bin/python bench/responses_vs_chat.py --json out/responses_vs_chat.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from multiturn_vs_vllm import Server, free_port  # noqa: E402

from sage_infer.serving_bench.stats import percentile  # noqa: E402

SAGE = str(Path(sys.executable).parent / "sage")
RETENTION_METRICS = ("sage:kv_retained_evicted_total", "sage:kv_retention_dropped_total",
                     "sage:kv_retained_blocks", "sage:kv_retained_conversations")


def later_steps(document: dict, block_size: int) -> dict:
    """TTFT percentiles of steps 2 and later, the share of each previous step's context (full blocks) the server
    said it served from the cache, and the mean prompt tokens it computed per step (prompt - cached)."""
    requests = [r for r in document["requests"] if r["error"] is None]
    by_key = {(r["conversation"], r["turn"]): r for r in requests}
    ttfts, history, hit, computed = [], 0, 0, []
    for r in requests:
        before = by_key.get((r["conversation"], r["turn"] - 1))
        if r["turn"] == 0 or before is None:
            continue
        ttfts.append(r["ttft_ms"])
        computed.append(r["prompt_tokens"] - (r["cached_tokens"] or 0))
        context = (before["prompt_tokens"] + before["output_tokens"]) // block_size * block_size
        history += context
        hit += min(r["cached_tokens"] or 0, context)
    return {"steps": len(ttfts), "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
            "history_hit": hit / history if history else None,
            "computed_prompt_tokens": statistics.mean(computed) if computed else None,
            "errors": len(document["requests"]) - len(requests),
            "error_messages": document["errors"]}


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in RETENTION_METRICS:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def agent_command(args: argparse.Namespace, url: str, api: str, seed: int, out: Path) -> list[str]:
    return [SAGE, "llm", "bench", "--url", url, "--workload", "agent", "--api", api, "--num-requests",
            str(args.agents * args.turns), "--turns", str(args.turns), "--prefix-len", str(args.prefix_len),
            "--context-len", str(args.context_len), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--concurrency", str(args.concurrency), "--seed", str(seed), "--json", str(out)]


def one_run(args: argparse.Namespace, url: str, api: str, seed: int, work: Path) -> dict:
    """The other traffic, and under it one agent run."""
    noise = subprocess.Popen(
        [SAGE, "llm", "bench", "--url", url, "--workload", "random", "--num-requests", str(args.noise_requests),
         "--input-len", str(args.noise_len), "--output-len", "1", "--concurrency", str(args.noise_concurrency),
         "--seed", str(seed + 1000), "--vocab-size", "4000", "--json", str(work / "noise.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = work / f"agent-{api}-{seed}.json"
    try:
        time.sleep(args.noise_lead_s)  # the pool is full of other traffic before the first session starts
        subprocess.run(agent_command(args, url, api, seed, out), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        throughout = noise.poll() is None  # the other traffic outlasted the agent run
    finally:
        os.killpg(noise.pid, signal.SIGINT)
        try:
            noise.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(noise.pid, signal.SIGKILL)
            noise.wait()
    return {"api": api, "seed": seed, "noise_throughout": throughout,
            **later_steps(json.loads(out.read_text()), args.block_size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled demo model")
    p.add_argument("--num-blocks", type=int, default=256, help="device KV blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--set", action="append", default=[], help="more server settings (KEY=VALUE)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--agents", type=int, default=4, help="agent conversations per run")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=100)
    p.add_argument("--context-len", type=int, default=40)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--noise-len", type=int, default=400)
    p.add_argument("--noise-requests", type=int, default=5000, help="more than the agent run outlasts")
    p.add_argument("--noise-concurrency", type=int, default=3)
    p.add_argument("--noise-lead-s", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    settings = ["--set", f"kv_pool.num_blocks={args.num_blocks}", *[x for s in args.set for x in ("--set", s)],
                *(["--model", args.model] if args.model else [])]
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.rounds):
            for api in ("chat", "responses"):
                # a fresh server per run: no run finds another's cached or retained blocks
                port = free_port()
                with Server("sage", [SAGE, "llm", "serve", "--port", str(port), *settings],
                            {**os.environ, "OMP_NUM_THREADS": str(args.threads)}, Path(work) / "sage.log",
                            port) as server:
                    runs.append(one_run(args, server.url, api, 100 * (i + 1) + (api == "responses"), Path(work)))
                    runs[-1]["metrics"] = scrape(server.url)
                r = runs[-1]
                print(f"{api:>9} seed {r['seed']}: TTFT p50 {r['ttft_p50_ms']:.0f} p90 {r['ttft_p90_ms']:.0f} ms, "
                      f"history hit {r['history_hit']:.1%}, computed {r['computed_prompt_tokens']:.0f} tok/step, "
                      f"errors {r['errors']}, noise throughout {r['noise_throughout']}", flush=True)
    summary = {api: {key: statistics.median(r[key] for r in runs if r["api"] == api)
                     for key in ("ttft_p50_ms", "ttft_p90_ms", "history_hit", "computed_prompt_tokens")}
               for api in ("chat", "responses")}
    summary["responses_over_chat"] = {key: statistics.median(
        r[key] / c[key] for c, r in zip(runs[::2], runs[1::2])) for key in ("ttft_p50_ms", "ttft_p90_ms")}
    print(json.dumps(summary, indent=1))
    write_json(args.json, {"settings": vars(args) | {"json": str(args.json)}, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
