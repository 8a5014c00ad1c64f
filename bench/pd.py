"""Prefill/decode separation (1P1D) against one colocated server, same requests, in one run.

    PYTHONPATH=$PWD .venv/bin/python bench/pd.py --json out/pd.json

Each deployment is started as users start it, in its own processes: `sage llm serve` (colocated)
and `sage llm serve --pd 1P1D` (router + prefill worker + decode worker). They run one after
the other, never at once (this machine has 2 cores). The same workload goes through
`serving_bench.run_workload` (streaming completions, greedy, ignore_eos); reported per
deployment: TTFT and TPOT p50/p99, output tokens/s, and for 1P1D the KV bytes moved, the mean
transfer time against the mean prefill time (from the workers' own /metrics), and the achieved
transfer GB/s against `sage transport bench`'s path on the same backend (the transport engine
moving the same bytes between two processes, measured in the same run), and the time spent converting KV
between dtypes (both workers' `sage:pd_transfer_convert_seconds`) as a share of the 1P1D requests' time
(with `--kv-transport preset=low-cost`, int8 on the wire: the design's "conversion <= 5 %"). Greedy outputs must be
identical. Model: a random Llama (tests/tiny_models.py) with 16-token blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import write_json  # noqa: E402
from sage_infer.serving_bench.runner import run_workload  # noqa: E402
from sage_infer.serving_bench.stats import percentile  # noqa: E402
from sage_infer.serving_bench.workloads import random_workload  # noqa: E402
from sage_infer.transport.bench import run_transport  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

READY = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1")
WORKERS = re.compile(r"(prefill|decode)-\d+ (http://\S+?)[,)]")


def start(args: list[str]) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """Start `sage llm serve ...`; its URL and (for --pd) the workers' URLs by role."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sage llm serve {' '.join(args)} exited before it served")
        match = READY.search(line)
        if match:
            return proc, match.group(1), {role: url for role, url in WORKERS.findall(line)}
    raise RuntimeError("no ready line in 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def transfer_metrics(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.startswith(("sage:pd_", "sage:e2e_request_latency_seconds_")):
                key = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[key] = s.value
    return out


def summarize(run, label: str, texts: list[list[int]]) -> dict:
    ok = [r for r in run.results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {"deployment": label, "requests": len(run.results), "errors": len(run.results) - len(ok),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50) if tpot else None,
            "tpot_p99_ms": 1e3 * percentile(tpot, 99) if tpot else None,
            "output_tok_s": out_tokens / run.duration_s, "duration_s": run.duration_s,
            "cached_tokens": sum(r.cached_tokens or 0 for r in ok), "texts": texts,
            "e2e_s_sum": sum(r.e2e_s for r in ok if r.e2e_s is not None)}


def greedy_texts(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The deployment's greedy completion of each prompt (non-streaming), to compare deployments."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    out = []
    for prompt in prompts:
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        out.append(reply.json()["choices"][0]["text"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", default="shm", choices=["shm", "tcp", "torchdist"])
    parser.add_argument("--kv-transport", action="append", default=[], metavar="KEY=VALUE",
                        help="more transport settings for the 1P1D deployment, e.g. preset=low-cost (repeatable)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sage-pd-bench-"))
    model = make_tiny_model(work / "model", "llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * args.hidden,
                            vocab_size=512, max_position_embeddings=4096)
    common = ["--model", str(model), "--set", "model.dtype=fp32", "--set", "kv_pool.num_blocks=2048",
              "--set", "scheduler.max_num_seqs=8"]
    workload = random_workload(args.requests, args.input_len, args.output_len, 512, seed=0)
    arrivals = [0.0] * args.requests

    results, transfer = [], {}
    for label, extra in (("colocated", []), ("1P1D", ["--pd", "1P1D", "--kv-transport", f"backend={args.backend}",
                                                    *(a for kv in args.kv_transport for a in ("--kv-transport", kv))])):
        proc, url, workers = start(common + extra)
        try:
            run = asyncio.run(run_workload(url, None, None, workload, arrivals, args.concurrency))
            probes = [c[0].prompt_ids() for c in workload.conversations[:4]]
            results.append(summarize(run, label, greedy_texts(url, probes, args.output_len)))
            if workers:
                transfer = {"prefill": transfer_metrics(workers["prefill"]),
                            "decode": transfer_metrics(workers["decode"])}
        finally:
            stop(proc)

    p, d = transfer["prefill"], transfer["decode"]
    sends = p.get("sage:pd_transfers_total|send|ok", 0)
    moved = p.get("sage:pd_transfer_bytes_total|send", 0.0)
    # receive side: from registering the expected blocks to the last verified chunk (what decode waits);
    # send side: the transport's own first-chunk-to-last-ACK time (what the bytes took)
    wait_s = d.get("sage:pd_transfer_seconds_total|receive", 0.0) / max(1, d.get(
        "sage:pd_transfers_total|receive|ok", 0))
    transfer_s = p.get("sage:pd_transfer_seconds_total|send", 0.0) / max(1, sends)
    prefill_s = p.get("sage:e2e_request_latency_seconds_sum", 0.0) / max(1, p.get(
        "sage:e2e_request_latency_seconds_count", 0))
    per_transfer = int(moved / max(1, sends))
    achieved = moved / max(1e-9, p.get("sage:pd_transfer_seconds_total|send", 0.0)) / 1e9
    peer_gbps = float(run_transport(args.backend, max(per_transfer, 1 << 16), 4 << 20, "fp32", "fp32",
                                    repeats=3)["gbps"])
    converting = sum(w.get(f"sage:pd_transfer_convert_seconds_total|{side}", 0.0)
                     for w, side in ((p, "send"), (d, "receive")))
    request_s = results[1]["e2e_s_sum"]
    same = results[0]["texts"] == results[1]["texts"]
    report = {
        "machine": platform.platform(), "cpu_count": os.cpu_count(), "args": vars(args) | {"json": str(args.json)},
        "deployments": [{k: v for k, v in r.items() if k != "texts"} for r in results],
        "transfer": {"transfers": sends, "bytes": moved, "bytes_per_transfer": per_transfer,
                     "mean_transfer_s": transfer_s, "mean_decode_wait_s": wait_s, "mean_prefill_request_s": prefill_s,
                     "transfer_over_prefill": transfer_s / prefill_s if prefill_s else None,
                     "achieved_gb_s": achieved, "transport_bench_gb_s": peer_gbps,
                     "achieved_over_transport_bench": achieved / peer_gbps if peer_gbps else None,
                     "convert_s": converting, "requests_s": request_s,
                     "convert_over_requests": converting / request_s if request_s else None},
        "greedy_outputs_identical": same,
    }
    print(f"{'deployment':<10} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'out tok/s':>10} errors")
    for r in report["deployments"]:
        tpot50 = f"{r['tpot_p50_ms']:.1f}" if r["tpot_p50_ms"] is not None else "-"
        tpot99 = f"{r['tpot_p99_ms']:.1f}" if r["tpot_p99_ms"] is not None else "-"
        print(f"{r['deployment']:<10} {r['ttft_p50_ms']:>8.1f}m {r['ttft_p99_ms']:>7.1f}m {tpot50:>8}m "
              f"{tpot99:>7}m {r['output_tok_s']:>10.1f} {r['errors']}")
    t = report["transfer"]
    print(f"\n1P1D KV: {t['transfers']:.0f} transfers, {t['bytes'] / 2**20:.1f} MiB "
          f"({t['bytes_per_transfer'] / 1024:.0f} KiB each); transfer {1e3 * t['mean_transfer_s']:.2f} ms vs "
          f"prefill request {1e3 * t['mean_prefill_request_s']:.1f} ms -> {t['transfer_over_prefill'] or 0:.3f}; "
          f"decode waits {1e3 * t['mean_decode_wait_s']:.1f} ms per request (pull request + transfer)")
    print(f"achieved {t['achieved_gb_s']:.2f} GB/s vs transport bench {t['transport_bench_gb_s']:.2f} GB/s "
          f"({args.backend}) -> {t['achieved_over_transport_bench'] or 0:.2f}")
    print(f"KV dtype conversion {converting:.3f} s over both workers = {t['convert_over_requests'] or 0:.4f} of the "
          f"1P1D requests' {request_s:.1f} s (send -> end of stream, summed)")
    print(f"greedy outputs identical: {same}")
    if args.json:
        write_json(args.json, report, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
