"""KV format conversion speed and error: encode / decode GB/s of KV chunks per wire format, beside a raw copy.

    python bench/kv_convert.py --sizes 1MiB,16MiB --threads 2 --json out/kv_convert.json

GB/s is source (fp16 or bf16, `--dtype`) bytes over the median time of `--repeats` runs,
encoding into and decoding into preallocated buffers (`out=`), as the transport engine does;
the peer is a copy of the same source bytes into a preallocated buffer (`copy GB/s`), and
`enc/copy`, `dec/copy` are the ratios. The codec is the KV pool's own (`kv_codec`). Prints a
table and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from pydantic import ByteSize, TypeAdapter

from sage_infer.core.dtypes import FLOAT_DTYPES
from sage_infer.transport.format import (
    WIRE_FORMATS,
    decode,
    encode,
    encoded_nbytes,
    is_lossless,
    reconstruction_error,
)

COLS = 128  # head_dim


STAT = statistics.median  # --stat min: the best run, for a machine shared with other work


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm: fault pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return STAT(times)


def kv_chunk(nbytes: int, seed: int = 0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[rows, 128] of `dtype` with a per-channel spread and a few outlier channels, like a K cache."""
    g = torch.Generator().manual_seed(seed)
    rows = nbytes // (COLS * 2)
    channel_scale = torch.rand(COLS, generator=g).mul_(2).add_(0.1)
    channel_scale[:4] *= 20
    return (torch.randn(rows, COLS, generator=g) * channel_scale).to(dtype)


def measure(x: torch.Tensor, fmt: str, granularity: str, repeats: int) -> dict:
    rows, cols = x.shape
    payload = torch.empty(encoded_nbytes(fmt, rows, cols, granularity), dtype=torch.uint8)
    decoded = torch.empty_like(x)
    copy_s = median_seconds(lambda: decoded.copy_(x), repeats)
    enc_s = median_seconds(lambda: encode(x, fmt, granularity, out=payload), repeats)
    dec_s = median_seconds(lambda: decode(payload, fmt, rows, cols, x.dtype, granularity, out=decoded), repeats)
    err = reconstruction_error(x, fmt, granularity)
    src = x.numel() * x.element_size()
    return {
        "fmt": fmt,
        "granularity": granularity,
        "bytes": src,
        "shape": [rows, cols],
        "encode_gb_s": src / enc_s / 1e9,
        "decode_gb_s": src / dec_s / 1e9,
        "copy_gb_s": src / copy_s / 1e9,
        "encode_us": enc_s * 1e6,
        "decode_us": dec_s * 1e6,
        "compression": err.compression,
        "rel_rmse": err.rel_rmse,
        "max_abs": err.max_abs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1MiB,16MiB")
    parser.add_argument("--formats", default=",".join(f for f in WIRE_FORMATS if not is_lossless(f)))
    parser.add_argument("--granularity", default="per_token")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="the KV's dtype before encoding")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in args.sizes.split(",")]
    results = [
        measure(kv_chunk(size, dtype=FLOAT_DTYPES[args.dtype]), fmt, args.granularity, args.repeats)
        for size in sizes
        for fmt in args.formats.split(",")
    ]
    print(
        f"{args.dtype} [rows, {COLS}] {args.granularity}, torch {torch.__version__}, {args.threads} threads, "
        f"{args.stat} of {args.repeats}"
    )
    print(f"{'size':>6} {'format':>13} {'enc GB/s':>9} {'dec GB/s':>9} {'copy GB/s':>9} {'enc/copy':>8} "
          f"{'dec/copy':>8} {'ratio':>6} {'rel_rmse':>9} {'max_abs':>9}")
    for r in results:
        print(
            f"{r['bytes'] / 2**20:>4.0f}Mi {r['fmt']:>13} {r['encode_gb_s']:>9.2f} {r['decode_gb_s']:>9.2f} "
            f"{r['copy_gb_s']:>9.2f} {r['encode_gb_s'] / r['copy_gb_s']:>8.2f} "
            f"{r['decode_gb_s'] / r['copy_gb_s']:>8.2f} "
            f"{r['compression']:>6.2f} {r['rel_rmse']:>9.2e} {r['max_abs']:>9.2e}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats, "dtype": args.dtype,
                "stat": args.stat}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
