"""Compression: quantized KV dtypes and quantized weights against bf16, on the engine itself.

    python bench/compression.py --json out/compression.json
    python bench/compression.py --models demo --quick

Method
  Models     the bundled demo model (4M Llama, trained on Shakespeare: its perplexity means something)
             and a random Qwen2.5-0.5B shape (bench/vllm_models.py; perplexity of random weights is
             near the vocabulary size and only the error columns mean something there). bf16 weights.
  Variants   KV: bf16 (the reference), fp8_e4m3, fp8_e5m2, int8, int4 (`kv_pool.kv_dtype`, one fp16
             scale (+ min) per token and head). Weights: w8a16, w4a16 with group 128 and 32, written
             by `sage compress quantize` (round to nearest) and loaded by the engine, KV bf16.
  Scoring    `quantization.evaluation.score_windows`: teacher-forced windows of the held-out split
             (the last 5% of every text, `quantization.calibration`), every position attending to the
             KV as the pool stores it. Perplexity, mean / max |logit - reference logit|, and top-1
             agreement with the reference's logits, over all positions.
  Greedy     `--prompts` held-out windows cut to 64 tokens, `--greedy-tokens` greedy tokens each
             (ignore_eos): the share of tokens generated before the first one that differs from the
             reference, averaged over prompts.
  Capacity   KV blocks of the model in 1 GiB (`KVPool.blocks_for_config`), and the ratio to bf16.
  Speed      batch 1 (one 128-token prompt, `--decode-tokens` out) and batch 32 (32 such prompts,
             32 out each), greedy, ignore_eos, best of `--runs`: decode tok/s = tokens after each
             request's first / (last finish - last first token), i.e. prefill excluded; output tok/s
             (all tokens / wall, prefill included) is in the JSON too.
  Weights    bytes of the model's parameters and buffers as loaded (quantized codes and scales).
  Hit rate   the Mooncake conversation trace replayed as in bench/tiers.py (tiny fp32 Llama, device pool
             only) with the device pool at the same bytes in each KV dtype: `--device-frac` of the
             distinct blocks in bf16 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.tiers import build_prompts  # noqa: E402
from bench.vllm_models import DEMO_DIR, MODELS, prepare_model  # noqa: E402
from sage_infer import LLM, SamplingParams  # noqa: E402
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig  # noqa: E402
from sage_infer.kv_runtime.pool import KVPool  # noqa: E402
from sage_infer.quantization.evaluation import score_windows  # noqa: E402
from sage_infer.sim.replay import distinct_blocks, load_mooncake  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
WEIGHT_SCHEMES = ("w8a16", "w4a16-g128", "w4a16-g32")
TRACE = Path("/work/shared/traces/mooncake/conversation_trace.jsonl")
CACHE = Path.home() / ".cache" / "sage_infer" / "engine_vs_vllm"
GIB = 1 << 30
# targets: capacity vs bf16, perplexity within a share of bf16's, decode speed-up at batch 1
GOALS = {"int8": (1.9, 0.01), "fp8_e4m3": (1.9, 0.01), "int4": (3.5, 0.05)}
WEIGHT_GOALS = {"w8a16": (1.7, 0.01), "w4a16-g128": (2.5, 0.05), "w4a16-g32": (2.5, 0.05)}


def build(model_dir: Path, kv_dtype: str = "bf16", num_blocks: int = 512, max_num_seqs: int = 64) -> LLM:
    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="bf16"),
                         kv_pool=KVPoolConfig(kv_dtype=kv_dtype, num_blocks=num_blocks),
                         scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    return LLM(config=config, device="cpu")


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:  # tied embeddings count once (packed weights have no data_ptr)
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    """Mean share of tokens generated before the first that differs from the reference."""
    shares = []
    for ref, got in zip(reference, tokens):
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        shares.append(first / len(ref))
    return sum(shares) / len(shares)


def decode_speed(llm: LLM, prompt: list[int], batch: int, max_tokens: int, runs: int) -> tuple[float, float]:
    """(output tok/s, decode tok/s) of `batch` copies of `prompt`, best of `runs`. Decode counts the tokens
    after each request's first, over the time from the last first token to the last finish (prefill excluded)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt] * batch, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    best_total, best_decode = float("inf"), float("inf")
    for _ in range(runs):
        llm.engine.kv.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([prompt] * batch, params)
        best_total = min(best_total, time.perf_counter() - start)
        first = max(o.metrics.first_token_time for o in outs)
        best_decode = min(best_decode, max(o.metrics.finish_time for o in outs) - first)
    return batch * max_tokens / best_total, batch * (max_tokens - 1) / best_decode


def measure(name: str, llm: LLM, windows: torch.Tensor, prompts: list[list[int]], reference: dict | None,
            args: argparse.Namespace) -> tuple[dict, dict]:
    """One variant's row, and what a later variant compares against (its logits and greedy tokens)."""
    engine = llm.engine
    scores = score_windows(engine, windows, keep_logits=True)
    tokens = greedy(llm, prompts, args.greedy_tokens)
    pool = engine.runner.pool
    row = {"variant": name, "kv_dtype": engine.kv_dtype, "perplexity": scores.perplexity,
           "weight_bytes": weight_bytes(llm),
           "kv_blocks_per_gib": KVPool.blocks_for_config(pool.schema, KVPoolConfig(block_size=pool.block_size,
                                                                                    memory_budget=GIB)),
           "kv_bytes_per_token": pool.schema.bytes_per_token()}
    if reference is not None:
        err = (scores.logits - reference["logits"]).abs()
        row |= {"logit_err_mean": err.mean().item(), "logit_err_max": err.max().item(),
                "top1_agreement": (scores.logits.argmax(-1) == reference["logits"].argmax(-1)).float().mean().item(),
                "greedy_agreement": agreement(reference["tokens"], tokens)}
    prompt = windows[0, :128].tolist()
    row["output_tok_s_b1"], row["decode_tok_s_b1"] = decode_speed(llm, prompt, 1, args.decode_tokens, args.runs)
    row["output_tok_s_b32"], row["decode_tok_s_b32"] = decode_speed(llm, prompt, 32, 32, args.runs)
    print(f"  {name:<12} ppl {row['perplexity']:9.3f}  blocks/GiB {row['kv_blocks_per_gib']:7d}  "
          f"b1 {row['decode_tok_s_b1']:6.1f} tok/s  b32 {row['decode_tok_s_b32']:7.1f} tok/s"
          + (f"  |dlogit| mean {row['logit_err_mean']:.4f} max {row['logit_err_max']:.3f}  top1 "
             f"{row['top1_agreement']:.4f}  greedy {row['greedy_agreement']:.3f}" if reference else ""), flush=True)
    return row, {"logits": scores.logits, "tokens": tokens}


def ratios(rows: list[dict]) -> None:
    base = rows[0]
    for row in rows:
        row["capacity_ratio"] = row["kv_blocks_per_gib"] / base["kv_blocks_per_gib"]
        row["perplexity_ratio"] = row["perplexity"] / base["perplexity"]
        row["decode_b1_ratio"] = row["decode_tok_s_b1"] / base["decode_tok_s_b1"]
        row["decode_b32_ratio"] = row["decode_tok_s_b32"] / base["decode_tok_s_b32"]
        row["weight_ratio"] = row["weight_bytes"] / base["weight_bytes"]


def quantize_checkpoint(model_dir: Path, scheme: str, out: Path) -> Path | None:
    """`sage compress quantize` (round to nearest) into `out`; None when sage refuses the scheme for this
    model (the refusal is printed: e.g. group 128 on the demo model, whose down_proj has 704 inputs)."""
    from sage_infer.cli.main import main as sage

    target = out / f"{model_dir.name}-{scheme}"
    name, _, group = scheme.partition("-g")
    argv = ["compress", "quantize", str(model_dir), str(target), "--scheme", name, "--method", "rtn"]
    if group:
        argv += ["--group-size", group]
    return target if sage(argv) == 0 else None


def run_model(spec_name: str, tokenizer_windows, args: argparse.Namespace, work: Path) -> dict:
    model_dir = prepare_model(MODELS[spec_name], CACHE)
    windows, prompts = tokenizer_windows
    print(f"{spec_name}: {windows.shape[0]} windows of {windows.shape[1]} tokens, {len(prompts)} greedy prompts",
          flush=True)
    kv_rows, reference = [], None
    for kv_dtype in args.kv_dtypes:
        row, seen = measure(f"kv-{kv_dtype}", build(model_dir, kv_dtype), windows, prompts, reference, args)
        reference = reference or seen
        kv_rows.append(row)
    ratios(kv_rows)
    weight_rows = [kv_rows[0]]
    skipped = {}
    for scheme in args.weight_schemes:
        quantized = quantize_checkpoint(model_dir, scheme, work)
        if quantized is None:
            skipped[scheme] = "sage compress quantize refused it for this model (see the line above)"
            continue
        row, _ = measure(scheme, build(quantized), windows, prompts, reference, args)
        weight_rows.append(row)
    ratios(weight_rows)
    return {"model": spec_name, "model_dir": str(model_dir), "kv": kv_rows, "weights": weight_rows[1:],
            "skipped": skipped}


def hit_rates(args: argparse.Namespace, work: Path) -> list[dict]:
    """The Mooncake conversation trace on a device-only pool of the same bytes in each KV dtype."""
    requests = load_mooncake(TRACE)[: args.trace_requests]
    block, vocab = 16, 512
    prompts = build_prompts(requests, block, vocab, 0)
    model_dir = make_tiny_model(work / "tiers-llama", "llama", vocab_size=vocab, hidden_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=341, max_position_embeddings=8192)
    distinct = distinct_blocks(requests)
    rows = []
    device_bytes = None
    for kv_dtype in args.kv_dtypes:
        probe = LLM(config=ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                                       kv_pool=KVPoolConfig(kv_dtype=kv_dtype, num_blocks=8)), device="cpu")
        block_bytes = probe.engine.runner.pool.block_nbytes
        if device_bytes is None:  # the first (bf16) sets the bytes every dtype gets
            longest = max(len(p) for p in prompts) // block + 1
            device_bytes = max(round(args.device_frac * distinct), longest + 4) * block_bytes
        blocks = device_bytes // block_bytes
        config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                             kv_pool=KVPoolConfig(kv_dtype=kv_dtype, block_size=block, num_blocks=blocks),
                             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048))
        llm = LLM(config=config, device="cpu")
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        cached = total = 0
        for i in range(0, len(prompts), 4):  # a conversation's next turn comes after its previous one
            for out in llm.generate(prompts[i : i + 4], params):
                cached += out.metrics.num_cached_tokens
                total += len(out.prompt_token_ids)
        rows.append({"kv_dtype": kv_dtype, "device_bytes": device_bytes, "device_blocks": blocks,
                     "distinct_blocks": distinct, "hit_rate": cached / total})
        print(f"  trace {kv_dtype:<9} {blocks:6d} blocks in {device_bytes / 2**20:.1f} MiB  hit rate "
              f"{cached / total:.2%}", flush=True)
    return rows


def print_report(report: dict) -> None:
    for model in report["models"]:
        print(f"\n{model['model']}")
        print(f"  {'variant':<12} {'ppl':>9} {'ppl/bf16':>8} {'cap x':>6} {'|dlogit|':>9} {'max':>7} {'top1':>6} "
              f"{'greedy':>6} {'b1 x':>6} {'b32 x':>6} {'weights MB':>10}")
        for row in model["kv"] + model["weights"]:
            print(f"  {row['variant']:<12} {row['perplexity']:9.3f} {row['perplexity_ratio']:8.4f} "
                  f"{row['capacity_ratio']:6.2f} {row.get('logit_err_mean', 0):9.4f} "
                  f"{row.get('logit_err_max', 0):7.3f} "
                  f"{row.get('top1_agreement', 1):6.3f} {row.get('greedy_agreement', 1):6.3f} "
                  f"{row['decode_b1_ratio']:6.2f} {row['decode_b32_ratio']:6.2f} {row['weight_bytes'] / 1e6:10.2f}")
    if report["hit_rates"]:
        print("\nMooncake conversation trace, device pool of the same bytes")
        for row in report["hit_rates"]:
            print(f"  {row['kv_dtype']:<9} {row['device_blocks']:6d} blocks  hit rate {row['hit_rate']:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,qwen2.5-0.5b-shape", help="empty: only the trace hit rates")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="the first is the reference")
    parser.add_argument("--weight-schemes", default=",".join(WEIGHT_SCHEMES), help="empty: none")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows scored (demo; 0.5B: a quarter)")
    parser.add_argument("--window-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64, help="output tokens of the batch-1 speed run")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--trace-requests", type=int, default=1000, help="0: no hit-rate run")
    parser.add_argument("--device-frac", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="4 windows, 2 prompts, 1 run, 100 trace requests")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.windows, args.prompts, args.runs, args.trace_requests = 4, 2, 1, min(args.trace_requests, 100)
    args.kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    args.weight_schemes = [s for s in args.weight_schemes.split(",") if s]
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from sage_infer.quantization.calibration import heldout_windows

    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))  # the 0.5B shape carries the same one
    work = Path(tempfile.mkdtemp(prefix="sage-compression-bench-"))
    models = []
    for name in [m for m in args.models.split(",") if m]:
        n = args.windows if name == "demo" else max(1, args.windows // 4)
        windows = heldout_windows(tokenizer, n, args.window_len)
        prompts = [w[:64].tolist() for w in heldout_windows(tokenizer, args.prompts, 64)]
        models.append(run_model(name, (windows, prompts), args, work))
    report = {
        "header": {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
                   "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "started": started,
                   "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": [load0, os.getloadavg()],
                   "args": {k: v for k, v in vars(args).items() if k != "json"}},
        "models": models,
        "hit_rates": hit_rates(args, work) if args.trace_requests else [],
    }
    report["goals"] = goals(report)
    print_report(report)
    for line in report["goals"]:
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwrote {args.json}")


def goals(report: dict) -> list[str]:
    lines = []
    for model in report["models"]:
        for row in model["kv"]:
            dtype = row["kv_dtype"]
            if dtype in GOALS:
                cap, ppl = GOALS[dtype]
                lines.append(f"{model['model']} {dtype} KV: capacity {row['capacity_ratio']:.2f}x (goal >= {cap}) "
                             f"{'met' if row['capacity_ratio'] >= cap else 'NOT met'}; perplexity "
                             f"{row['perplexity_ratio'] - 1:+.2%} (goal within {ppl:.0%}) "
                             f"{'met' if abs(row['perplexity_ratio'] - 1) <= ppl else 'NOT met'}")
        for row in model["weights"]:
            speed, ppl = WEIGHT_GOALS[row["variant"]]
            lines.append(f"{model['model']} {row['variant']}: batch-1 decode {row['decode_b1_ratio']:.2f}x (goal >= "
                         f"{speed}) {'met' if row['decode_b1_ratio'] >= speed else 'NOT met'}; perplexity "
                         f"{row['perplexity_ratio'] - 1:+.2%} (goal within {ppl:.0%}) "
                         f"{'met' if abs(row['perplexity_ratio'] - 1) <= ppl else 'NOT met'}")
    rates = report["hit_rates"]
    if len(rates) > 1:
        base = rates[0]["hit_rate"]
        for row in rates[1:]:
            rises = "rises" if row["hit_rate"] > base else "does NOT rise"
            lines.append(f"trace hit rate {row['kv_dtype']} {row['hit_rate']:.2%} vs {rates[0]['kv_dtype']} "
                         f"{base:.2%} at the same device bytes: {rises}")
    return lines


if __name__ == "__main__":
    main()
