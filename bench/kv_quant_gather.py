"""What a quantized KV pool costs attention per layer and step: `gather_blocks` and `store` in each KV dtype.

    python bench/kv_quant_gather.py --json out/kv_quant_gather.json
    python bench/kv_quant_gather.py --batch 1 --context 4096

A decode step gathers every sequence's whole context (K and V of one layer, padded block tables)
and stores one token per sequence. The float pool gathers with one `index_select`; a quantized
pool also widens the codes and multiplies by the per-token scales (`KVCodec.decode`). Ratios are
against bf16 in the same run; best of `--repeats` after a warm-up, `--threads` torch threads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.host_copy import best_seconds  # noqa: E402
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype  # noqa: E402
from sage_infer.kv_runtime.pool import make_kv_pool  # noqa: E402

DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


def measure(kv_dtype: str, args: argparse.Namespace) -> dict:
    schema = KVCacheSchema(1, args.kv_heads, args.head_dim, args.block_size).with_dtype(KVDtype(kv_dtype))
    blocks_per_seq = -(-args.context // args.block_size)
    pool = make_kv_pool(schema, args.batch * blocks_per_seq + 1)
    tokens = args.batch * blocks_per_seq * args.block_size
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(tokens, args.kv_heads, args.head_dim, generator=gen).to(torch.bfloat16)
    pool.store(0, kv, kv, torch.arange(tokens))
    tables = torch.arange(args.batch * blocks_per_seq).view(args.batch, blocks_per_seq)
    one = kv[: args.batch]
    slots = torch.arange(args.batch) * blocks_per_seq * args.block_size
    gather = best_seconds(lambda: pool.gather_blocks(0, tables, torch.bfloat16), args.repeats)
    store = best_seconds(lambda: pool.store(0, one, one, slots), args.repeats)
    return {"kv_dtype": kv_dtype, "gather_ms": gather * 1e3, "store_us": store * 1e6,
            "kv_bytes_read": pool.block_nbytes * args.batch * blocks_per_seq,
            "gather_gb_s": pool.block_nbytes * args.batch * blocks_per_seq / gather / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(d, args) for d in DTYPES]
    base = rows[0]
    print(f"batch {args.batch} x context {args.context}, {args.kv_heads} KV heads x {args.head_dim}, "
          f"{torch.get_num_threads()} threads; one layer, K and V")
    print(f"  {'kv dtype':<9} {'gather ms':>9} {'x bf16':>7} {'GB/s':>6} {'store us':>9} {'x bf16':>7}")
    for row in rows:
        row["gather_ratio"] = row["gather_ms"] / base["gather_ms"]
        row["store_ratio"] = row["store_us"] / base["store_us"]
        print(f"  {row['kv_dtype']:<9} {row['gather_ms']:9.3f} {row['gather_ratio']:7.2f} {row['gather_gb_s']:6.2f} "
              f"{row['store_us']:9.1f} {row['store_ratio']:7.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "threads": torch.get_num_threads(), "rows": rows}, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
