"""The CPU kernels under a layer's attention kind (sliding window, soft-cap, sinks) against the PyTorch math they
replace (`sage_infer.layers.attention_kinds`: the path such layers took before the kernels took them), per call.

    python bench/attention_kind_kernels.py                 # gpt-oss-shaped heads (8/2 x 64), window 128, sinks
    python bench/attention_kind_kernels.py --heads 4/1 --head-dim 256 --window 512 --softcap 50 --no-sinks

Method
  Decode   `--batch` rows of `--context` tokens each in a float pool (fp32, block 16, shuffled blocks): the paged
           kernel in place (`decode_attention_kind`) against the gather of each row's window blocks +
           `kind_decode_attention` (what `AttentionBackend.forward_kind` ran).
  Prefill  one span of `--context` tokens from the start: the flash kernel (`flash_attention_kind`) against
           `kind_prefill_attention`.
  Timing   best of `--repeats` after one warm-up; one torch thread by default (`--threads`). The machine's load
           average is printed: on a shared machine compare the two columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--heads", default="8/2", help="query heads / KV heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128, help="0: no window")
    parser.add_argument("--softcap", type=float, default=0.0, help="0: none")
    parser.add_argument("--no-sinks", action="store_true")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.kv_runtime.pool import make_kv_pool
    from sage_infer.layers.attention_backends.flash_prefill import flash_attention_kind
    from sage_infer.layers.attention_backends.paged_decode import decode_attention_kind
    from sage_infer.layers.attention_kinds import (
        AttentionKind,
        kind_decode_attention,
        kind_prefill_attention,
        window_tables,
    )
    from sage_infer.layers.cpu_kernels import kernel_level

    torch.set_num_threads(args.threads)
    heads, kv_heads = map(int, args.heads.split("/"))
    d, block = args.head_dim, 16
    kind = AttentionKind(window=args.window or None, softcap=args.softcap or None,
                         sinks=None if args.no_sinks else torch.randn(heads))
    scale = d**-0.5
    per_row = -(-args.context // block)
    pool = make_kv_pool(KVCacheSchema(1, kv_heads, d, block).with_dtype(KVDtype.FP32), per_row * args.batch + 1)
    slots = torch.arange(pool.num_blocks * block)
    pool.store(0, torch.randn(len(slots), kv_heads, d), torch.randn(len(slots), kv_heads, d), slots)
    tables = torch.randperm(pool.num_blocks)[: per_row * args.batch].view(args.batch, per_row)
    lens = torch.full((args.batch,), args.context)
    q = torch.randn(args.batch, heads, d)

    def torch_decode():
        t, n = (tables, lens) if kind.window is None else window_tables(tables, lens, kind.window, block)
        keys, values = pool.gather_blocks(0, t, torch.float32)
        return kind_decode_attention(q, keys, values, n, scale, kind)

    qp, kp, vp = torch.randn(args.context, heads, d), torch.randn(args.context, kv_heads, d), \
        torch.randn(args.context, kv_heads, d)
    rows = [("decode", lambda: decode_attention_kind(q, pool, 0, tables, lens, scale, kind), torch_decode),
            ("prefill", lambda: flash_attention_kind(qp, kp, vp, scale, kind),
             lambda: kind_prefill_attention(qp, kp, vp, scale, kind))]
    print(f"kernels {kernel_level()}; {kind.describe()}; heads {args.heads} x {d}; context {args.context}; "
          f"decode batch {args.batch}; {args.threads} thread(s); load average {os.getloadavg()[0]:.1f}")
    print(f"{'':8} {'kernel ms':>10} {'PyTorch ms':>11} {'speedup':>8}")
    for name, kernel, reference in rows:
        k, r = best(kernel, args.repeats), best(reference, args.repeats)
        print(f"{name:8} {k * 1e3:>10.3f} {r * 1e3:>11.3f} {r / k:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
