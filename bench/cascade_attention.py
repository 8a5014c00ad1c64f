"""Cascade attention on and off (`model.cascade_attention`), A/B in one process.

    python bench/cascade_attention.py --model qwen3-11m --repeats 5 --json out/cascade_attention.json
    python bench/cascade_attention.py --kernel --dtype bf16      # one attention layer, a grid of sizes

Workloads are those of bench/engine_vs_vllm.py (same token ids for the same seed):
  W1  64 prompts of 64-512 random tokens, 128 output tokens each (no shared prefix: the switch
      must cost nothing there)
  W2  64 x (one shared 1,024-token prefix + 32 unique tokens), 32 output tokens each
Greedy, ignore-EOS, every request submitted at once. Each run builds a fresh `LLM` (empty
prefix cache, so the shared prefix is computed once per run: the scheduler defers the others
a step), warms it up on unrelated prompts, then times `generate`. The two modes alternate
within every repeat (on, off, then off, on, ...); the table shows the best and the median
output tok/s of each, and whether both modes produced identical greedy tokens (expected in
fp32). `cascade steps` counts the engine steps whose attention used a shared prefix.

--kernel times `paged_attention` alone (one layer, 6/2 heads, head_dim 64, block 16) for B
decode rows behind S shared blocks plus about 2 blocks of their own, cascade metadata against
the reference path's, whatever the engine's break-even (`MIN_SAVED_TOKENS`) would decide:
the two alternate, best of 8 x 4 calls each. It is where that break-even comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_hf import random_workload  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE, build_workloads  # noqa: E402
from bench.vllm_models import MODELS, model_facts, prepare_model  # noqa: E402

MODES = {"on": True, "off": False}


def run_once(model_dir: Path, dtype: str, cascade: bool, prompts: list[list[int]], max_new: int,
             warmup: list[list[int]], kv_gib: int) -> tuple[dict, list[list[int]]]:
    from sage_infer import LLM, SamplingParams
    from sage_infer.config.serve import ServeConfig

    config = ServeConfig.model_validate({
        "model": {"path": str(model_dir), "dtype": dtype, "cascade_attention": cascade},
        "kv_pool": {"memory_budget": f"{kv_gib}GiB"},
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
    })
    llm = LLM(config=config, device="cpu")
    llm.generate(warmup, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    runner = llm.engine.runner
    steps_before = runner.cascade_steps
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    cpu0, start = time.process_time(), time.monotonic()
    outs = llm.generate(prompts, params)
    wall, cpu = time.monotonic() - start, time.process_time() - cpu0
    if errors := [o.error for o in outs if o.error]:
        raise RuntimeError(f"failed requests: {errors[:3]}")
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.first_token_time - start for o in outs]
    row = {"wall_s": wall, "cpu_util": cpu / wall, "output_tok_s": generated / wall,
           "ttft_mean_s": statistics.fmean(ttfts), "cascade_steps": runner.cascade_steps - steps_before,
           "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outs)}
    return row, [o.outputs[0].token_ids for o in outs]


def run_workload(name: str, prompts: list[list[int]], max_new: int, args, model_dir: Path,
                 warmup: list[list[int]], log) -> dict:
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    same = []
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        tokens = {}
        for mode in order:
            row, tokens[mode] = run_once(model_dir, args.dtype, MODES[mode], prompts, max_new, warmup, args.kv_gib)
            runs[mode].append(row)
            log(f"{name} repeat {repeat + 1} cascade {mode}: {row['output_tok_s']:.1f} tok/s, "
                f"{row['wall_s']:.2f} s, cpu {row['cpu_util']:.2f}, cascade steps {row['cascade_steps']}")
        same.append(sum(a == b for a, b in zip(tokens["on"], tokens["off"])))
    summary = {mode: {"best_tok_s": max(r["output_tok_s"] for r in rows),
                      "median_tok_s": statistics.median(r["output_tok_s"] for r in rows),
                      "median_ttft_mean_s": statistics.median(r["ttft_mean_s"] for r in rows),
                      "cascade_steps": rows[0]["cascade_steps"]} for mode, rows in runs.items()}
    return {"workload": name, "requests": len(prompts), "max_new": max_new, "summary": summary,
            "identical_greedy_tokens": same, "runs": runs}


def kernel_grid(dtype_name: str, rows_list: list[int], shared_list: list[int], log) -> list[dict]:
    import random

    import torch

    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.core.sampling_params import SamplingParams
    from sage_infer.core.sequence import Sequence
    from sage_infer.engine.model_runner import ModelRunner
    from sage_infer.kv_runtime import KVPool
    from sage_infer.layers.attention import paged_attention

    heads, kv_heads, head_dim, block = 6, 2, 64, 16
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    num_blocks = max(rows_list) * 4 + max(shared_list) + 1
    pool = KVPool(KVCacheSchema(1, kv_heads, head_dim, block, KVDtype.FP32), num_blocks, dtype=dtype)

    def mean_ms(q, k, v, meta, calls: int = 4) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            paged_attention(q, k, v, pool, 0, meta, head_dim**-0.5)
        return (time.perf_counter() - start) / calls * 1e3

    results = []
    for b in rows_list:
        for s in shared_list:
            free = list(range(num_blocks))
            random.Random(0).shuffle(free)
            prefix = [free.pop() for _ in range(s)]
            seqs = []
            for i in range(b):
                computed = (s + 2) * block - 5 + i % 4
                table = prefix + [free.pop() for _ in range(-(-(computed + 1) // block) - s)]
                seq = Sequence(i, "r", 0, list(range(computed + 1)), computed + 1, SamplingParams(), b"")
                seq.block_table, seq.num_computed_tokens = table, computed
                seqs.append(seq)
            q = torch.randn(b, heads, head_dim).to(dtype)
            k, v = torch.randn(b, kv_heads, head_dim).to(dtype), torch.randn(b, kv_heads, head_dim).to(dtype)
            metas = {}
            for mode, cascade in MODES.items():
                runner = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=cascade)
                runner.cascade_min_saved_tokens = 0  # time the cascade path even where the engine would not take it
                metas[mode] = runner.prepare(seqs, [1] * b)[1]
            best = {mode: float("inf") for mode in MODES}
            for _ in range(8):
                for mode, meta in metas.items():
                    paged_attention(q, k, v, pool, 0, meta, head_dim**-0.5)
                    best[mode] = min(best[mode], mean_ms(q, k, v, meta))
            row = {"rows": b, "shared_blocks": s, "saved_tokens": (b - 1) * s * block,
                   "on_ms": best["on"], "off_ms": best["off"], "speedup": best["off"] / best["on"]}
            log(f"B={b:3d} S={s:4d} saved {row['saved_tokens']:6d} tokens: on {row['on_ms']:.3f} ms, "
                f"off {row['off_ms']:.3f} ms, {row['speedup']:.2f}x")
            results.append(row)
    return results


def print_table(report: dict) -> None:
    h = report["header"]
    print(f"\n{h['model']} ({h['dtype']}), {h['threads']} threads, best / median of {h['repeats']} run(s) per mode, "
          f"load average {h['loadavg_at_start'][0]:.2f} at start")
    print("| workload | cascade | best tok/s | median tok/s | mean TTFT (median) | cascade steps | on ÷ off (best) "
          "| identical tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for w in report["workloads"]:
        s = w["summary"]
        ratio = s["on"]["best_tok_s"] / s["off"]["best_tok_s"]
        same = ", ".join(f"{n}/{w['requests']}" for n in w["identical_greedy_tokens"])
        for mode in MODES:
            m = s[mode]
            print(f"| {w['workload']} | {mode} | {m['best_tok_s']:.1f} | {m['median_tok_s']:.1f} | "
                  f"{m['median_ttft_mean_s']:.2f} s | {m['cascade_steps']} | "
                  f"{f'{ratio:.2f}x' if mode == 'on' else ''} | {same if mode == 'on' else ''} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: the model's")
    parser.add_argument("--workloads", default="W2,W1", help="comma-separated subset of W1,W2")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4, help="KV cache memory, GiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="where built models are kept")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--kernel", action="store_true", help="time one attention layer over a grid instead")
    parser.add_argument("--rows", default="2,4,8,16,32,64", help="--kernel: decode rows sharing the prefix")
    parser.add_argument("--shared-blocks", default="4,8,16,32,64,128", help="--kernel: shared prefix lengths")
    args = parser.parse_args(argv)
    if args.kernel:
        import torch

        torch.set_num_threads(args.threads)
        dtype = args.dtype or "fp32"
        grid = kernel_grid(dtype, [int(x) for x in args.rows.split(",")],
                           [int(x) for x in args.shared_blocks.split(",")], lambda msg: print(msg, flush=True))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"dtype": dtype, "threads": args.threads, "grid": grid}, indent=2))
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in workloads if w not in ("W1", "W2")]:
        parser.error(f"unknown workload(s) {unknown}; choose from W1,W2")
    spec = MODELS[args.model]
    args.dtype = args.dtype or spec.dtype

    import torch

    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(spec, args.model_cache, args.seed)
    facts = model_facts(model_dir)
    all_workloads = build_workloads(facts["vocab_size"], facts["max_position_embeddings"], args.seed)
    warmup = random_workload(4, facts["vocab_size"], args.seed + 99, 16, 48)
    header = {"model": spec.name, "model_dir": str(model_dir), **facts, "dtype": args.dtype,
              "threads": args.threads, "kv_gib": args.kv_gib, "repeats": args.repeats, "torch": torch.__version__,
              "python": platform.python_version(), "cpu_count": os.cpu_count(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_at_start": os.getloadavg()}
    log(f"model {spec.name}: {model_dir} ({facts['params'] / 1e6:.1f} M params), {args.dtype}, {args.threads} threads")
    report = {"header": header, "workloads": [
        run_workload(name, *all_workloads[name], args, model_dir, warmup, log) for name in workloads]}
    header.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"), loadavg_at_end=os.getloadavg())
    print_table(report)
    if args.json:
        write_json(args.json, report, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
