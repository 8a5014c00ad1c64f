"""The fastest any engine could run an engine_vs_vllm workload on this CPU: the workload's arithmetic
with perfect prefix reuse, at the GEMM rate this machine reaches on the model's own layer shapes.

    python bench/arith_bound.py --model qwen2.5-0.5b-shape --dtype bf16 --workload W2 --peer-tok-s 138.8
    python bench/arith_bound.py --model qwen3-11m --dtype fp32 --workload W2 --peer-tok-s 1209.8

What is counted (no engine runs):
- rows through the decoder layers: every distinct prompt prefix once (the nodes of a token trie of the
  prompts: a shared system prompt counts once, as sage and vLLM both compute it once), plus one row per
  output token after the first; logits for each prompt's last token and every decode row;
- GEMM FLOPs: 2 × the layer weights per row (q/k/v, o, gate/up, down), 2 × the lm_head per logit row;
- attention FLOPs: 4 × heads × head_dim per (query, key) pair and layer (QK and P·V), causal: a prompt
  row at depth d attends d keys, a decode row its whole context.

The GEMM rate is measured here on the engine's own GEMM (`PackedLinear`: oneDNN on packed weights) for
the model's four layer shapes at the prefill chunk's rows (2048) and at the decode batch's rows, best of
`--repeats`, time-weighted.
Attention is charged at the prefill GEMM rate: a kernel that beats the GEMM rate on attention is not
known here, so the bound is optimistic, never pessimistic. `--peer-tok-s`: a measured peer (vLLM-CPU)
on the same workload, to print the most that any engine could be ahead of it.

Arithmetic only: a workload of a few sequences (W3, batch 1) is bound by reading the weights, not by
FLOPs, and this is no bound for it (engine_vs_vllm.py reports its weight reads against the bandwidth).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import ALL_WORKLOADS, build_workloads  # noqa: E402
from bench.vllm_models import DEMO_DIR, MODELS  # noqa: E402
from sage_infer.layers.linear import PackedLinear  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PREFILL_ROWS = 2048


def model_shape(name: str) -> dict:
    """the shape bench/vllm_models.py builds (the demo model's own for `demo`): no model is loaded"""
    spec, demo = MODELS[name], json.loads((DEMO_DIR / "config.json").read_text())
    if spec.arch is None:
        shape = {key: demo[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "intermediate_size", "max_position_embeddings")}
    else:
        shape = {"max_position_embeddings": 4096, **spec.shape}
    shape.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    shape.setdefault("vocab_size", demo["vocab_size"])
    return shape


def layer_shapes(s: dict) -> list[tuple[int, int]]:
    """(in, out) of q/k/v stacked, o, gate/up stacked and down. A mixture of experts' MLP is a token's top-k experts:
    the products of a dense MLP k experts wide (its FLOPs; the GEMM rate measured on that dense shape is at least a
    grouped expert product's, so the bound stays a bound)"""
    h, d = s["hidden_size"], s["head_dim"]
    inter = s["num_experts_per_tok"] * s["moe_intermediate_size"] if s.get("num_experts") else s["intermediate_size"]
    return [(h, (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d), (s["num_attention_heads"] * d, h),
            (h, 2 * inter), (inter, h)]


def count_work(prompts: list[list[int]], max_tokens: int, s: dict) -> dict:
    trie: dict = {}
    prompt_rows = pairs_prompt = 0
    for prompt in prompts:
        node = trie
        for depth, token in enumerate(prompt, start=1):
            if token not in node:
                node[token] = {}
                prompt_rows += 1
                pairs_prompt += depth
            node = node[token]
    decode_rows = len(prompts) * (max_tokens - 1)
    pairs_decode = sum(len(p) + j for p in prompts for j in range(1, max_tokens))
    layer_weights = sum(i * o for i, o in layer_shapes(s)) * s["num_hidden_layers"]
    per_pair = 4 * s["num_attention_heads"] * s["head_dim"] * s["num_hidden_layers"]
    head = 2 * s["hidden_size"] * s["vocab_size"]
    return {"prompt_rows": prompt_rows, "decode_rows": decode_rows, "logit_rows": len(prompts) + decode_rows,
            "output_tokens": len(prompts) * max_tokens,
            "gemm_prefill_gflop": 2 * layer_weights * prompt_rows / 1e9,
            "gemm_decode_gflop": (2 * layer_weights * decode_rows + head * (len(prompts) + decode_rows)) / 1e9,
            "attention_gflop": per_pair * (pairs_prompt + pairs_decode) / 1e9}


def gemm_rate(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of one pass over the layer's four products at `rows` rows on the engine's own GEMM (oneDNN's
    packed weights, `PackedLinear`): each shape's best of `repeats` rounds, the shapes taking turns, so a
    slow stretch of this VM (its compute rate moves up to ~2x between seconds) hits every shape"""
    products = [(PackedLinear(torch.nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)),
                 torch.randn(rows, fan_in, dtype=dtype)) for fan_in, fan_out in shapes]
    best = [float("inf")] * len(products)
    with torch.inference_mode():
        for product, x in products:
            product(x)
        for _ in range(repeats):
            for i, (product, x) in enumerate(products):
                start = time.perf_counter()
                product(x)
                best[i] = min(best[i], time.perf_counter() - start)
    total_flop = sum(2 * rows * fan_in * fan_out for fan_in, fan_out in shapes)
    return total_flop / sum(best) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-shape", choices=sorted(MODELS))
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the model's bench dtype")
    parser.add_argument("--workload", default="W2", choices=ALL_WORKLOADS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--peer-tok-s", type=float, default=None, help="a peer's measured output tok/s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype or MODELS[args.model].dtype
    shape = model_shape(args.model)
    prompts, max_tokens = build_workloads(shape["vocab_size"], shape["max_position_embeddings"])[args.workload]
    work = count_work(prompts, max_tokens, shape)
    shapes = layer_shapes(shape)
    prefill_rate = gemm_rate(shapes, PREFILL_ROWS, DTYPES[dtype], args.repeats)
    decode_rate = gemm_rate(shapes, len(prompts), DTYPES[dtype], args.repeats)
    seconds = ((work["gemm_prefill_gflop"] + work["attention_gflop"]) / prefill_rate
               + work["gemm_decode_gflop"] / decode_rate)
    report = {"model": args.model, "dtype": dtype, "workload": args.workload, "threads": args.threads, **work,
              "gemm_gflop_s_prefill": prefill_rate, "gemm_gflop_s_decode": decode_rate, "min_seconds": seconds,
              "max_output_tok_s": work["output_tokens"] / seconds}
    print(f"{args.model} {dtype} {args.workload}: {work['prompt_rows']:,} prompt rows (each distinct prefix once), "
          f"{work['decode_rows']:,} decode rows, {work['output_tokens']:,} output tokens")
    print(f"  GEMM {work['gemm_prefill_gflop']:.1f} GFLOP prefill + {work['gemm_decode_gflop']:.1f} decode; "
          f"attention {work['attention_gflop']:.1f} GFLOP")
    print(f"  GEMM rate {prefill_rate:.0f} GFLOP/s at {PREFILL_ROWS} rows, {decode_rate:.0f} at {len(prompts)} "
          f"({args.threads} threads)")
    print(f"  at least {seconds:.2f} s: at most {report['max_output_tok_s']:,.1f} output tok/s")
    if len(prompts) < 8:
        print(f"  {args.workload} decodes {len(prompts)} sequence(s) at a time: bound by weight reads, not arithmetic, "
              "so this is no bound for it")
    if args.peer_tok_s:
        report["peer_tok_s"] = args.peer_tok_s
        report["max_ratio_over_peer"] = report["max_output_tok_s"] / args.peer_tok_s
        print(f"  against a peer at {args.peer_tok_s:,.1f} tok/s: at most {report['max_ratio_over_peer']:.2f}x")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
