"""A conversation's next turn with its history cached: what its first token costs, beside the same turn
recomputed whole, transformers on the same new tokens, and the arithmetic of those tokens on this CPU.

    python bench/cached_turn.py --model qwen2.5-0.5b-shape --dtype fp32 --history 576 --new 80

One process, one request at a time (no queue, no other request sharing a step), best of `--repeats`:
  sage cached     `LLM.generate` of history + new with the history computed by an earlier request (its full
                  blocks in the prefix cache): the new tokens' prefill, sampling the first token.
  sage whole      the same length with nothing cached: what an engine that lost the history pays.
  hf cached       transformers' forward of the new tokens over the history's `past_key_values` (the history's
                  forward not timed).
  hf whole        transformers' forward of history + new (both hf rows compute every row's logits; the
                  demo tokenizer's vocabulary makes that a small part).
  bound           the new rows' GEMM FLOPs and attention FLOPs (each new token attends the history and the
                  new tokens before it) at the GEMM rate the engine's own GEMM (`PackedLinear`) reaches on the
                  model's layer shapes at that many rows (bench/arith_bound.py's rate).

This is what is left of a cached turn's TTFT under light load: in bench/multiturn_vs_vllm.py a turn also waits
for the steps of other requests it arrives behind.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.arith_bound import DTYPES, gemm_rate, layer_shapes, model_shape  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402
from sage_infer.serving_bench.workloads import random_token_ids  # noqa: E402


def bound_seconds(shape: dict, history: int, new: int, rate_gflop_s: float) -> tuple[float, float]:
    """(GFLOP, seconds at `rate_gflop_s`) of `new` rows after `history` cached ones: the decoder layers' GEMMs,
    attention over history + the causal part of the new tokens, and the head for the last row only."""
    layers = shape["num_hidden_layers"]
    gemm = 2 * new * sum(i * o for i, o in layer_shapes(shape)) * layers
    pairs = new * history + new * (new + 1) // 2
    attention = 4 * shape["num_attention_heads"] * shape["head_dim"] * layers * pairs
    head = 2 * shape["hidden_size"] * shape["vocab_size"]
    gflop = (gemm + attention + head) / 1e9
    return gflop, gflop / rate_gflop_s


def time_sage(model_dir: Path, dtype: str, history: int, new: int, vocab: int, repeats: int, seed: int) -> dict:
    from sage_infer import LLM, SamplingParams

    blocks = 2 * (history + new) // 16 + 8
    llm = LLM(str(model_dir), dtype=dtype, num_blocks=blocks, max_model_len=history + new + 8)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(seed)
    cached, whole, hits = [], [], []
    for _ in range(repeats):
        turn = random_token_ids(rng, history + new, vocab)
        llm.generate([turn[:history]], one)  # the earlier turn: its full blocks stay cached
        start = time.perf_counter()
        out = llm.generate([turn], one)[0]
        cached.append(time.perf_counter() - start)
        hits.append(out.metrics.num_cached_tokens)
        fresh = random_token_ids(rng, history + new, vocab)
        start = time.perf_counter()
        llm.generate([fresh], one)
        whole.append(time.perf_counter() - start)
    return {"cached_s": min(cached), "whole_s": min(whole), "cached_tokens": min(hits)}


def time_hf(model_dir: Path, dtype: str, history: int, new: int, vocab: int, repeats: int, seed: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    rng = random.Random(seed)
    cached, whole = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            ids = torch.tensor([random_token_ids(rng, history + new, vocab)])
            past = model(ids[:, :history], use_cache=True).past_key_values
            start = time.perf_counter()
            model(ids[:, history:], past_key_values=past, use_cache=True)
            cached.append(time.perf_counter() - start)
            start = time.perf_counter()
            model(ids, use_cache=True)
            whole.append(time.perf_counter() - start)
    return {"cached_s": min(cached), "whole_s": min(whole)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-shape", choices=[m for m in MODELS if m != "demo"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the model's bench dtype")
    parser.add_argument("--history", type=int, default=576, help="tokens of the conversation so far (cached)")
    parser.add_argument("--new", type=int, default=80, help="tokens the turn adds (the last answer and the question)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm-repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", type=Path, default=Path("/tmp/sage-bench-models"))
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out (a quicker run)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = args.dtype or MODELS[args.model].dtype
    shape = model_shape(args.model)
    model_dir = prepare_model(MODELS[args.model], args.model_cache)
    rate = gemm_rate(layer_shapes(shape), args.new, DTYPES[dtype], args.gemm_repeats)
    gflop, bound = bound_seconds(shape, args.history, args.new, rate)
    sage = time_sage(model_dir, dtype, args.history, args.new, shape["vocab_size"], args.repeats, args.seed)
    hf = (None if args.skip_hf else
          time_hf(model_dir, dtype, args.history, args.new, shape["vocab_size"], args.repeats, args.seed))
    report = {"model": args.model, "dtype": dtype, "history": args.history, "new": args.new,
              "threads": args.threads, "gemm_gflop_s": rate, "new_tokens_gflop": gflop, "bound_s": bound,
              "sage": sage, "hf": hf}
    print(f"{args.model} {dtype}, a turn of {args.new} new tokens after {args.history} cached, {args.threads} threads "
          f"(best of {args.repeats}):")
    rows = [("sage cached", sage["cached_s"]), ("sage whole", sage["whole_s"])]
    if hf:
        rows += [("hf cached", hf["cached_s"]), ("hf whole", hf["whole_s"])]
    rows.append((f"bound ({gflop:.1f} GFLOP at {rate:.0f} GFLOP/s)", bound))
    for name, seconds in rows:
        print(f"  {name:<40} {seconds * 1e3:>8.1f} ms  {seconds / sage['cached_s']:>6.2f}x sage cached")
    print(f"  sage cached found {sage['cached_tokens']} of the {args.history} history tokens cached")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
