"""One layer of decode attention: the paged kernel (reads pool blocks in place) against the
pure-PyTorch reference path (`paged_attention` with sorted groups of 16 gathered rows: fp32
pools masked SDPA, bf16 pools `gather_block_levels` + `decode_attention_scaled`).

    python bench/paged_decode_kernel.py --threads 1
    python bench/paged_decode_kernel.py --threads 2 --json out/paged_decode_kernel.json
    python bench/paged_decode_kernel.py --threads 2 --step     # one whole decode step from a 2 GB pool
    python bench/paged_decode_kernel.py --threads 2 --kv-dtype int8 --json out/paged_decode_int8.json

Shapes: qwen3-11m (6 query / 2 KV heads x 64, fp32 pool) and the Qwen2.5-0.5B shape (14 / 2 x 64,
bf16 pool); batch x context lengths drawn uniformly in [lo, hi] (seed 0), blocks of 16 in a
shuffled pool. Each case: best of 5 rounds of 5 calls, reference and kernel alternating, through
`paged_attention` (the step's K/V store included, as in the engine). GB/s = K and V bytes of the
contexts / kernel time.

`--kv-dtype int8`: the same cases on an int8 pool (`QuantizedKVPool`): the reference is its PyTorch path
(`gather_block_levels` + `decode_attention_scaled`), the kernel `decode_attention_paged_int8` reading the codes and
fp16 scales in place; GB/s counts the codes and the scales.

`--device cuda`: the same cases on an NVIDIA GPU, where the kernel is the Triton one
(`sage_infer.layers.triton_paged`) and the reference the same PyTorch path on the GPU; plus
`GPU_CASES` (bigger batches and longer contexts), timed with a device sync around each round of 20
calls, and the device's read bandwidth measured in the same run (a sum over 2 GB) to compare against.

    python bench/paged_decode_kernel.py --device cuda --json out/paged_decode_kernel_cuda.json

`--step`: the kernel alone over all 24 layers of a 0.5B-shape decode step, 64 rows of 200-630
tokens whose blocks are scattered over a ~2 GB bf16 pool (far past the L3, as in the engine), on a
pool of 4 KiB pages and one on 2 MiB pages (`KVPool(huge_pages=True)`), timed alternately: best of
10 steps each, and ns per (row, context token) of one layer.
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
from sage_infer.kv_runtime import KVPool  # noqa: E402
from sage_infer.kv_runtime.pool import make_kv_pool  # noqa: E402
from sage_infer.layers.attention import AttentionMetadata, DecodeGroup, decode_groups, paged_attention  # noqa: E402
from sage_infer.layers.attention_backends import PAGED_DECODE, REFERENCE, AttentionBackend  # noqa: E402
from sage_infer.layers.attention_backends.base import DECODE_GROUP_ROWS  # noqa: E402
from sage_infer.layers.attention_backends.paged_decode import PagedDecode  # noqa: E402
from sage_infer.layers.cpu_kernels import decode_attention_paged_int8  # noqa: E402

SHAPES = {"qwen3-11m fp32": (6, 2, 64, torch.float32), "qwen2.5-0.5b bf16": (14, 2, 64, torch.bfloat16)}
CASES = [(64, 64, 640), (64, 1024, 1100), (16, 64, 640), (1, 128, 384), (1, 4000, 4096)]
GPU_CASES = [(256, 1024, 1100), (64, 4000, 4096), (256, 4000, 4096)]
BLOCK = 16


class Int8PagedDecode(PagedDecode):
    """`PagedDecode` over an int8 pool: its codes and scales read in place from the pool's storage, laid out as
    `QuantizedKVPool`'s docstring says (the pool has no public view of them)."""

    def attend_lse(self, q: torch.Tensor, pool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = pool._codes[:, layer].view(torch.int8), pool._params[:, layer]
        return decode_attention_paged_int8(q, codes[0], codes[1], scales[0], scales[1], group.block_tables,
                                           group.context_lens, scale)


INT8_PAGED_DECODE = AttentionBackend(decode=Int8PagedDecode(), prefill=REFERENCE.prefill)


def case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int, lo: int, hi: int,
         device: torch.device = torch.device("cpu"), int8: bool = False):
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 1
    schema = KVCacheSchema(1, num_kv_heads, head_dim, BLOCK)
    if int8:
        pool = make_kv_pool(schema.with_dtype(KVDtype.INT8), num_blocks, device=device)
        pool._codes.random_(0, 256)  # (the bench may fill the storage directly: random codes and scales)
        pool._params.uniform_(0.005, 0.02)
    else:
        pool = KVPool(schema, num_blocks, dtype=dtype, device=device)
        pool._kv.normal_()  # (the bench may fill the storage directly: every slot holds a random key)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    q = torch.randn(batch, num_heads, head_dim).to(dtype).to(device)
    k, v = (torch.randn(batch, num_kv_heads, head_dim).to(dtype).to(device) for _ in range(2))
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)], device=device)

    def meta(in_place: bool) -> AttentionMetadata:
        groups = decode_groups(list(range(batch)), tables, lens,
                                            lambda values: torch.tensor(values, dtype=torch.long, device=device),
                                            1 << 30 if in_place else DECODE_GROUP_ROWS)
        kernel = INT8_PAGED_DECODE if int8 else PAGED_DECODE
        return AttentionMetadata(slots, [], None, groups, backend=kernel if in_place else REFERENCE)

    metas = {"reference": meta(False), "kernel": meta(True)}
    calls = {name: (lambda m=m: paged_attention(q, k, v, pool, 0, m, head_dim**-0.5)) for name, m in metas.items()}
    diff = (calls["reference"]().float() - calls["kernel"]().float()).abs().max().item()
    best = {name: float("inf") for name in calls}
    calls_per_round = 5 if device.type == "cpu" else 20
    for _ in range(5):
        for name, call in calls.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(calls_per_round):
                call()
            sync(device)
            best[name] = min(best[name], (time.perf_counter() - start) / calls_per_round)
    nbytes = sum(lens) * num_kv_heads * 2 * (head_dim + 2 if int8 else head_dim * dtype.itemsize)
    return {"batch": batch, "context": [lo, hi], "reference_ms": best["reference"] * 1e3,
            "kernel_ms": best["kernel"] * 1e3, "speedup": best["reference"] / best["kernel"],
            "kernel_gb_s": nbytes / best["kernel"] / 1e9, "kv_mb": nbytes / 1e6, "max_abs_diff": diff}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_read_gb_s(device: torch.device, nbytes: int = 2 << 30) -> float:
    """The device memory's read bandwidth: the best of 10 sums over `nbytes` of bf16 (one read each)."""
    data = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        data.sum(dtype=torch.float32)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del data
    return nbytes / best / 1e9


def whole_step(threads: int) -> dict:
    """`--step`: one decode step's attention, all 24 layers, from a 4 KiB-page and a huge-page pool."""
    from sage_infer.layers.cpu_kernels import decode_attention_paged

    num_heads, num_kv_heads, head_dim, dtype = SHAPES["qwen2.5-0.5b bf16"]
    layers, num_blocks = 24, 10000
    rng = random.Random(0)
    lens = [rng.randint(200, 630) for _ in range(64)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context = torch.tensor(lens)
    q = torch.randn(64, num_heads, head_dim).to(dtype).float()
    schema = KVCacheSchema(layers, num_kv_heads, head_dim, BLOCK, KVDtype.FP32)
    pools = {name: KVPool(schema, num_blocks, dtype=dtype, huge_pages=huge) for name, huge in
             (("4 KiB pages", False), ("2 MiB pages", True))}
    for pool in pools.values():
        pool._kv.normal_()  # (the bench may fill the storage directly)
    best = {name: float("inf") for name in pools}
    for _ in range(10):
        for name, pool in pools.items():
            start = time.perf_counter()
            for layer in range(layers):
                decode_attention_paged(q, *pool.block_views(layer), table, context, head_dim ** -0.5)
            best[name] = min(best[name], time.perf_counter() - start)
    tokens = sum(lens) * layers
    print(f"one decode step, 24 layers, 64 rows x 200-630 tokens, {num_blocks} blocks "
          f"({pools['4 KiB pages']._kv.numel() * 2 / 1e9:.1f} GB), {threads} threads")
    for name, seconds in best.items():
        print(f"  {name:<12} {seconds * 1e3:8.2f} ms  {seconds / tokens * 1e9:6.1f} ns per (row, token)")
    return {"step_ms": {name: t * 1e3 for name, t in best.items()}, "threads": threads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--step", action="store_true", help="one whole decode step from a 2 GB pool instead")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the Triton kernel against the PyTorch path on the GPU")
    parser.add_argument("--kv-dtype", default="float", choices=("float", "int8"),
                        help="int8: the shapes' pools in int8 (CPU), the int8 kernel against their PyTorch path")
    args = parser.parse_args(argv)
    if args.kv_dtype == "int8" and args.device != "cpu":
        parser.error("--kv-dtype int8: the int8 kernel runs on CPUs")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.step:
        report = whole_step(args.threads)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return 0
    rows = []
    where = f"{args.threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    read_gb_s = device_read_gb_s(device) if device.type == "cuda" else None
    if read_gb_s is not None:
        print(f"device read bandwidth (sum over 2 GB of bf16): {read_gb_s:.0f} GB/s")
    print(f"{'shape':<18} {'batch x context':>16} {'KV MB':>7} {'reference ms':>13} {'kernel ms':>10} {'x':>6} "
          f"{'GB/s':>6} {'max diff':>9}   ({where})")
    int8 = args.kv_dtype == "int8"
    for name, shape in SHAPES.items():
        name = name.rsplit(" ", 1)[0] + " int8" if int8 else name
        for batch, lo, hi in CASES + (GPU_CASES if device.type == "cuda" else []):
            row = {"shape": name, **case(*shape, batch, lo, hi, device, int8)}
            rows.append(row)
            print(f"{name:<18} {f'{batch} x {lo}-{hi}':>16} {row['kv_mb']:7.1f} {row['reference_ms']:13.3f} "
                  f"{row['kernel_ms']:10.3f} {row['speedup']:6.2f} {row['kernel_gb_s']:6.1f} "
                  f"{row['max_abs_diff']:9.1e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "device": where, "device_read_gb_s": read_gb_s,
                                         "kv_dtype": args.kv_dtype, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
