"""One layer of decode attention: the paged kernel (reads pool blocks in place) against the
pure-PyTorch reference path (`paged_attention` with sorted groups of 16 gathered rows: fp32
pools masked SDPA, bf16 pools `gather_block_levels` + `decode_attention_scaled`).

    python bench/paged_decode_kernel.py --threads 1
    python bench/paged_decode_kernel.py --threads 2 --json out/paged_decode_kernel.json

Shapes: qwen3-11m (6 query / 2 KV heads x 64, fp32 pool) and the Qwen2.5-0.5B shape (14 / 2 x 64,
bf16 pool); batch x context lengths drawn uniformly in [lo, hi] (seed 0), blocks of 16 in a
shuffled pool. Each case: best of 5 rounds of 5 calls, reference and kernel alternating, through
`paged_attention` (the step's K/V store included, as in the engine). GB/s = K and V bytes of the
contexts / kernel time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype  # noqa: E402
from sage_infer.engine.model_runner import DECODE_GROUP_ROWS, ModelRunner  # noqa: E402
from sage_infer.kv_runtime import KVPool  # noqa: E402
from sage_infer.layers.attention import AttentionMetadata, paged_attention  # noqa: E402

SHAPES = {"qwen3-11m fp32": (6, 2, 64, torch.float32), "qwen2.5-0.5b bf16": (14, 2, 64, torch.bfloat16)}
CASES = [(64, 64, 640), (64, 1024, 1100), (16, 64, 640), (1, 128, 384), (1, 4000, 4096)]
BLOCK = 16


def case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int, lo: int, hi: int):
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 1
    pool = KVPool(KVCacheSchema(1, num_kv_heads, head_dim, BLOCK, KVDtype.FP32), num_blocks, dtype=dtype)
    pool._kv.normal_()  # (the bench may fill the storage directly: every slot holds a random key)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    q = torch.randn(batch, num_heads, head_dim).to(dtype)
    k, v = torch.randn(batch, num_kv_heads, head_dim).to(dtype), torch.randn(batch, num_kv_heads, head_dim).to(dtype)
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)])

    def meta(in_place: bool) -> AttentionMetadata:
        groups = ModelRunner._decode_groups(list(range(batch)), tables, lens,
                                            lambda values: torch.tensor(values, dtype=torch.long),
                                            1 << 30 if in_place else DECODE_GROUP_ROWS)
        return AttentionMetadata(slots, [], None, groups, decode_in_place=in_place)

    metas = {"reference": meta(False), "kernel": meta(True)}
    calls = {name: (lambda m=m: paged_attention(q, k, v, pool, 0, m, head_dim**-0.5)) for name, m in metas.items()}
    diff = (calls["reference"]().float() - calls["kernel"]().float()).abs().max().item()
    best = {name: float("inf") for name in calls}
    for _ in range(5):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(5):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / 5)
    nbytes = sum(lens) * num_kv_heads * head_dim * 2 * dtype.itemsize
    return {"batch": batch, "context": [lo, hi], "reference_ms": best["reference"] * 1e3,
            "kernel_ms": best["kernel"] * 1e3, "speedup": best["reference"] / best["kernel"],
            "kernel_gb_s": nbytes / best["kernel"] / 1e9, "kv_mb": nbytes / 1e6, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'shape':<18} {'batch x context':>16} {'KV MB':>7} {'reference ms':>13} {'kernel ms':>10} {'x':>6} "
          f"{'GB/s':>6} {'max diff':>9}   ({args.threads} threads)")
    for name, shape in SHAPES.items():
        for batch, lo, hi in CASES:
            row = {"shape": name, **case(*shape, batch, lo, hi)}
            rows.append(row)
            print(f"{name:<18} {f'{batch} x {lo}-{hi}':>16} {row['kv_mb']:7.1f} {row['reference_ms']:13.3f} "
                  f"{row['kernel_ms']:10.3f} {row['speedup']:6.2f} {row['kernel_gb_s']:6.1f} "
                  f"{row['max_abs_diff']:9.1e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
