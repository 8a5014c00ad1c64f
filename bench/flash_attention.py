"""sage's flash kernel (`model.prefill_attention: sage`) against PyTorch's CPU flash kernel, per call.

    python bench/flash_attention.py --threads 2 --json out/flash_attention.json
    python bench/flash_attention.py --dtype fp32 --heads 6,2 --json out/flash_attention_fp32.json
    SAGE_CPU_ISA=avx2 python bench/flash_attention.py --lengths 512,2048 --stat median --json out/flash_avx2.json
    python bench/flash_attention.py --dtype fp32 --heads 6,2 --lengths 4096,16384,32768 --chunk 2048 --repeats 3
    python bench/flash_attention.py --heads 32,4 --head-dim 128 --json out/flash_attention_30b.json

Default: Qwen2.5-0.5B's attention shape (14 query / 2 KV heads x 64), bf16 q/k/v; `--dtype fp32
--heads 6,2` is the qwen3-11m bench model's (an fp32 model's prefill goes to the fp32 kernel), `--heads 32,4
--head-dim 128` Qwen3-30B-A3B's. Cases: causal prefill
chunks of W1's prompt lengths (100-500) and a 2,048-token one (reference: `prefill_attention`, one
causal SDPA call); a 32-token chunk after 1,024 cached
keys (W2's unique tail: PyTorch has no lower-right causal mask, so the engine's reference path splits
it into an unmasked and a causal call merged by log-sum-exp: `chunk_attention_lse`, timed here); the
shared prefix of W2's decode steps, 64 rows x 14 heads over 1,024 keys unmasked
(`shared_keys_attention_lse`, G heads folded into rows); `--lengths` keeps only first chunks of those
lengths, and with `--chunk N` the last N-token chunk of each instead (a long prompt's chunked prefill: N queries
after L - N cached keys, reference `chunk_attention_lse`). Best (or `--stat median`) of `--repeats` calls each,
the reference's and sage's alternating; "max diff" is against fp32 plain ops, for both kernels. The kernel is the
one of the ISA level in use (`SAGE_CPU_ISA` forces a lower one), named in the header and the JSON, with the kernel
the engine's bf16 prefill takes here (PyTorch's on a CPU with AMX tiles: `cpu_kernels.amx_flash_attention`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sage_infer.layers.attention import (  # noqa: E402
    chunk_attention_lse,
    prefill_attention,
    shared_keys_attention_lse,
)
from sage_infer.layers.cpu_kernels import (  # noqa: E402
    amx_flash_attention,
    flash_attention,
    flash_kernel,
    flash_unavailable,
    kernel_level,
)

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
CASES = [(100, 100, True), (300, 300, True), (500, 500, True), (2048, 2048, True), (32, 1056, True),
         (64, 1024, False), (2016, 4064, True)]


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block: int = 1024) -> torch.Tensor:
    """fp32 plain ops, `block` queries at a time (the scores of a 32K prompt at once would take 24 GiB)."""
    groups, lq, c = q.shape[1] // k.shape[1], q.shape[0], k.shape[0]
    kf, vf = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    out = []
    for q0 in range(0, lq, block):
        qb = q[q0:q0 + block].float()
        scores = torch.einsum("qhd,khd->hqk", qb, kf) * q.shape[-1] ** -0.5
        if causal:
            rows = torch.arange(q0, q0 + qb.shape[0])[:, None] + (c - lq)
            scores = scores.masked_fill(torch.arange(c)[None, :] > rows, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vf))
    return torch.cat(out)


def first_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor]:
    return (prefill_attention(q, k, v, scale),)


def timed(fns, repeats: int, stat: str) -> list[float]:
    """The best or the median of `repeats` calls of each of `fns` after a warm-up call, seconds; the calls
    alternate, so a burst of other load on the machine falls on all of them alike."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [min(t) if stat == "best" else statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--heads", default=f"{HEADS},{KV_HEADS}", help="query heads,KV heads")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--lengths", default=None, help="only first chunks (causal, queries = keys) of these "
                        "comma-separated lengths")
    parser.add_argument("--chunk", type=int, default=None, help="with --lengths: time the last CHUNK queries of "
                        "each length over the keys before them (chunked prefill) instead of the whole prompt")
    parser.add_argument("--stat", choices=("best", "median"), default="best")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    heads, kv_heads = (int(n) for n in args.heads.split(","))
    head_dim = args.head_dim
    if why := flash_unavailable(head_dim, dtype):
        sys.exit(f"sage's flash kernel cannot run here: {why}")
    cases = [(min(args.chunk or n, n), n, True) for n in map(int, args.lengths.split(","))] if args.lengths else CASES
    torch.set_num_threads(args.threads)
    scale = head_dim ** -0.5
    rows = []
    engine_takes = "PyTorch's (AMX tiles)" if amx_flash_attention(dtype) else "sage's"
    print(f"sage: {flash_kernel(dtype)}, kernels {kernel_level()}; the engine's prefill takes {engine_takes} here")
    print(f"{'queries x keys':>16} {'causal':>6} {'torch ms':>9} {'sage ms':>8} {'sage GFLOP/s':>13} "
          f"{'sage/torch':>11} {'max diff torch / sage':>22}   ({args.dtype}, {heads}/{kv_heads} heads x "
          f"{head_dim}, {args.threads} threads, {args.stat} of {args.repeats})")
    for lq, c, causal in cases:
        torch.manual_seed(lq + c)
        q = torch.randn(lq, heads, head_dim).to(dtype)
        k, v = torch.randn(c, kv_heads, head_dim).to(dtype), torch.randn(c, kv_heads, head_dim).to(dtype)
        if lq == c:  # a first chunk: one causal SDPA call (`prefill_attention`)
            reference = partial(first_chunk, q, k, v, scale)
        else:
            reference = partial(chunk_attention_lse if causal else shared_keys_attention_lse, q, k, v, scale)
        sage = partial(flash_attention, q, k, v, scale, causal)
        want = exact(q, k, v, causal)
        diffs = [(fn()[0].float() - want).abs().max().item() for fn in (reference, sage)]
        t_ref, t_sage = timed((reference, sage), args.repeats, args.stat)
        flops = 4 * heads * head_dim * (lq * c - (lq * lq / 2 if causal else 0))
        row = {"queries": lq, "keys": c, "causal": causal, "torch_ms": t_ref * 1e3, "sage_ms": t_sage * 1e3,
               "sage_gflop_s": flops / t_sage / 1e9, "speedup": t_ref / t_sage, "max_diff_torch": diffs[0],
               "max_diff_sage": diffs[1]}
        rows.append(row)
        print(f"{f'{lq} x {c}':>16} {causal!s:>6} {row['torch_ms']:9.2f} {row['sage_ms']:8.2f} "
              f"{row['sage_gflop_s']:13.1f} {row['speedup']:10.2f}x {diffs[0]:10.1e} / {diffs[1]:.1e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "dtype": args.dtype,
                                         "shape": [heads, kv_heads, head_dim], "torch": torch.__version__,
                                         "engine_takes": engine_takes,
                                         "kernel": flash_kernel(dtype), "kernels": kernel_level(),
                                         "stat": args.stat, "repeats": args.repeats, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
