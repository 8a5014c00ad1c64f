"""KV format conversion speed and error: encode / decode GB/s of fp16 KV chunks per wire format.

    python bench/kv_convert.py --sizes 1MiB,16MiB --threads 2 --json out/kv_convert.json

GB/s is source (fp16) bytes over the median time of `--repeats` runs, encoding into and
decoding into preallocated buffers (`out=`), as the transport engine does. Prints a table
and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from pydantic import ByteSize, TypeAdapter

from sage_infer.transport.format import (
    WIRE_FORMATS,
    decode,
    encode,
    encoded_nbytes,
    is_lossless,
    reconstruction_error,
)

COLS = 128  # head_dim


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm: fault pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kv_chunk(nbytes: int, seed: int = 0) -> torch.Tensor:
    """fp16 [rows, 128] with a per-channel spread and a few outlier channels, like a K cache."""
    g = torch.Generator().manual_seed(seed)
    rows = nbytes // (COLS * 2)
    channel_scale = torch.rand(COLS, generator=g).mul_(2).add_(0.1)
    channel_scale[:4] *= 20
    return (torch.randn(rows, COLS, generator=g) * channel_scale).half()


def measure(x: torch.Tensor, fmt: str, granularity: str, repeats: int) -> dict:
    rows, cols = x.shape
    payload = torch.empty(encoded_nbytes(fmt, rows, cols, granularity), dtype=torch.uint8)
    decoded = torch.empty_like(x)
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
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in args.sizes.split(",")]
    results = [
        measure(kv_chunk(size), fmt, args.granularity, args.repeats)
        for size in sizes
        for fmt in args.formats.split(",")
    ]
    print(
        f"fp16 [rows, {COLS}] {args.granularity}, torch {torch.__version__}, {args.threads} threads, "
        f"median of {args.repeats}"
    )
    print(f"{'size':>6} {'format':>13} {'enc GB/s':>9} {'dec GB/s':>9} {'ratio':>6} {'rel_rmse':>9} {'max_abs':>9}")
    for r in results:
        print(
            f"{r['bytes'] / 2**20:>4.0f}Mi {r['fmt']:>13} {r['encode_gb_s']:>9.2f} {r['decode_gb_s']:>9.2f} "
            f"{r['compression']:>6.2f} {r['rel_rmse']:>9.2e} {r['max_abs']:>9.2e}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
