"""Batch-1 decode with weight-only quantized checkpoints against the bf16 model, end to end in the engine.

    python bench/quant_decode.py --model qwen2.5-0.5b-shape --repeats 3 --json out/quant_decode.json

The model (bench/vllm_models.py: random weights, demo tokenizer, vocab 4096 so the linears are
almost all of the bytes) is quantized once per scheme with `quantize_checkpoint` (RTN) into the
cache directory. Every engine (bf16 on packed oneDNN linears, each quantized checkpoint on the CPU
int8 / int4 kernels; `model.linear` auto) is built once, warmed up, then the engines take turns:
each repeat times one 128-token prompt and `--max-tokens` greedy output tokens on each. Decode
tok/s = (output tokens - 1) / (wall time - TTFT); weight GB/s = the checkpoint's linear weight bytes
(quantized values + scales) read per decode step times decode tok/s. Table: median over repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.engine_vs_vllm import DEFAULT_CACHE  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402

SCHEMES = {"bf16": None, "w8a16": (8, None), "w4a16-g128": (4, 128), "w4a16-g32": (4, 32)}


def checkpoint(model_dir: Path, name: str, cache: Path) -> Path:
    from sage_infer.quantization.checkpoint import quantize_checkpoint
    from sage_infer.quantization.weights import WeightScheme

    if SCHEMES[name] is None:
        return model_dir
    out = cache / f"{model_dir.name}-{name}"
    if not (out / "config.json").exists():
        partial = cache / f".{out.name}.partial"
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
        quantize_checkpoint(model_dir, partial, WeightScheme(*SCHEMES[name]))
        partial.rename(out)
    return out


def linear_bytes(directory: Path, name: str) -> int:
    """Bytes the decoder linears read per decode step at run time: bf16 weights, or the quantized
    values (num_bits / 8 per weight) plus bf16 scales (int4: a bf16 scale and zero per group)."""
    from safetensors import safe_open

    from sage_infer.quantization.checkpoint import is_quantized_linear

    bits = 16 if SCHEMES[name] is None else SCHEMES[name][0]
    total = 0
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        for key in f.keys():
            prefix, _, suffix = key.rpartition(".")
            numel = math.prod(f.get_slice(key).get_shape())
            if is_quantized_linear(key):
                total += numel * 2
            elif suffix == "weight_shape" and is_quantized_linear(f"{prefix}.weight"):
                total += math.prod(f.get_tensor(key).tolist()) * bits // 8
            elif suffix == "weight_scale" and is_quantized_linear(f"{prefix}.weight"):
                total += numel * (4 if bits == 4 else 2)  # the int4 kernel reads a bf16 (scale, zero) pair
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-shape", choices=sorted(MODELS))
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from sage_infer import LLM, SamplingParams
    from sage_infer.config.serve import ServeConfig

    torch.set_num_threads(args.threads)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(MODELS[args.model], args.cache_dir)
    names = args.schemes.split(",")
    dirs = {name: checkpoint(model_dir, name, args.cache_dir) for name in names}
    engines = {name: LLM(config=ServeConfig.model_validate({"model": {"path": str(d), "dtype": "bf16"},
                                                           "kv_pool": {"memory_budget": "1GiB"}}))
               for name, d in dirs.items()}
    prompt = [[5 + (13 * j) % 4000 for j in range(128)]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():
        llm.generate([prompt[0][:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    runs: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            out = engines[name].generate(prompt, params)[0]
            wall = time.perf_counter() - start
            runs[name].append((args.max_tokens - 1) / (wall - out.metrics.ttft))
            tokens[name] = out.outputs[0].token_ids
            print(f"  repeat {repeat} {name:11} {runs[name][-1]:6.2f} decode tok/s", file=sys.stderr)
    base = statistics.median(runs[names[0]])
    rows = []
    for name in names:
        tok_s = statistics.median(runs[name])
        nbytes = linear_bytes(dirs[name], name)
        rows.append({"scheme": name, "decode_tok_s": tok_s, "runs": runs[name], "speedup": tok_s / base,
                     "linear_weight_bytes": nbytes, "weight_gb_s": nbytes * tok_s / 1e9,
                     "same_tokens_as_first": tokens[name] == tokens[names[0]]})
    print(f"\n{args.model}, bf16 activations, batch 1, 128-token prompt, {args.max_tokens} output tokens, "
          f"{args.threads} threads, median of {args.repeats}")
    print("| scheme | decode tok/s | vs bf16 | linear weights MB | weight GB/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['decode_tok_s']:.2f} | {r['speedup']:.2f}x | {r['linear_weight_bytes'] / 1e6:.0f} "
              f"| {r['weight_gb_s']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
                                         "repeats": args.repeats, "torch": torch.__version__, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
