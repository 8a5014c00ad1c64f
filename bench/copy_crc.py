"""The one-pass copy + CRC32C (`kv_codec_kernel.copy_crc32c`) against a raw copy and a copy followed by a CRC pass.

For each size, rounds alternate every variant (best of the rounds each, so a loaded machine slows them alike):
a numpy copy (the raw peer), numpy copy + the `crc32c` package (two passes), the kernel's CRC alone, the one-pass
kernel with plain and with streaming stores, and the one-pass kernel split over `--threads` threads; then the CRC
alone and the one-pass copy (stores chosen by size) with each CRC method the kernel runs here (`crc32`: the
SSE4.2 instruction; `pclmulqdq`, `vpclmulqdq-256`, `vpclmulqdq-512`: carry-less-multiply folding of 16, 32, 64
bytes). Destinations are cold (a rotation through 256 MiB of buffers, as a tier slab's free slots) or hot (one
buffer rewritten). `SAGE_CPU_ISA=avx2` measures the avx2 build.

    PYTHONPATH=$PWD .venv/bin/python bench/copy_crc.py --mib 0.016,0.25,2,4,16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np
import torch

from sage_infer.quantization import kv_codec_kernel

ROTATION_BYTES = 256 << 20


def variants(kernel, src: torch.Tensor, pool: concurrent.futures.ThreadPoolExecutor | None, threads: int
             ) -> dict[str, Callable[[torch.Tensor], object]]:
    s = src.numpy()

    def split(dst: torch.Tensor) -> None:
        step = -(-src.numel() // threads)
        parts = [(dst[k : k + step], src[k : k + step]) for k in range(0, src.numel(), step)]
        list(pool.map(lambda p: kernel.copy_crc32c(p[0], p[1], 0, -1), parts))  # (CRCs joined: not measured)

    out = {
        "raw copy": lambda d: np.copyto(d.numpy(), s),
        "copy, then crc32c": lambda d: (np.copyto(d.numpy(), s), crc32c.crc32c(d.numpy())),
        "kernel crc alone": lambda d: kernel.crc32c(src, 0),
        "one pass, plain stores": lambda d: kernel.copy_crc32c(d, src, 0, 0),
        "one pass, streaming stores": lambda d: kernel.copy_crc32c(d, src, 0, 1),
        "one pass, by size (default)": lambda d: kernel.copy_crc32c(d, src, 0, -1),
    }
    if pool is not None:
        out[f"one pass, {threads} threads"] = split
    for method in kernel.crc32c_methods() if hasattr(kernel, "crc32c_methods") else ():
        out[f"crc alone [{method}]"] = with_method(kernel, method, lambda d: kernel.crc32c(src, 0))
        out[f"one pass [{method}]"] = with_method(kernel, method, lambda d: kernel.copy_crc32c(d, src, 0, -1))
    return out


def with_method(kernel, method: str, f: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], object]:
    """`f` run with the kernel's CRC32C computed by `method` (switched untimed: the caller times only `f`)."""
    def run(d: torch.Tensor) -> object:
        return f(d)
    run.method = method  # type: ignore[attr-defined]
    return run


def measure(kernel, nbytes: int, cold: bool, rounds: int, pool, threads: int) -> dict[str, float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dsts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(max(1, ROTATION_BYTES // nbytes) if cold else 1)]
    fs = variants(kernel, src, pool, threads)
    default = kernel.crc32c_method() if hasattr(kernel, "crc32c_method") else None
    best = dict.fromkeys(fs, float("inf"))
    i = 0
    for _ in range(rounds):
        for name, f in fs.items():
            dst = dsts[i % len(dsts)]
            i += 1
            if default:  # (each variant's CRC method, switched outside the timing)
                kernel.crc32c_set_method(getattr(f, "method", default))
            t0 = time.perf_counter()
            f(dst)
            best[name] = min(best[name], time.perf_counter() - t0)
    if default:
        kernel.crc32c_set_method(default)
    return {name: nbytes / 1e9 / t for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="0.25,1,4,16,64", help="copy sizes, MiB")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per size (0: more for small sizes)")
    parser.add_argument("--threads", type=int, default=2, help="threads of the split variant (1: none)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kernel = kv_codec_kernel.fused_copy()
    if kernel is None:
        raise SystemExit(f"no one-pass copy kernel here: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    pool = concurrent.futures.ThreadPoolExecutor(args.threads) if args.threads > 1 else None
    rows = []
    method = kernel.crc32c_method() if hasattr(kernel, "crc32c_method") else "crc32"
    print(f"GB/s (ratio to the raw copy), best of the rounds; load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores; streaming from {kernel.copy_stream_min_bytes() >> 10} KiB by default; "
          f"{kv_codec_kernel.native().__name__}, CRC32C by {method} by default")
    for mib in (float(x) for x in args.mib.split(",")):
        nbytes = int(mib * (1 << 20))
        for cold in (True, False):
            rounds = args.rounds or max(5, int(64 / mib))
            got = measure(kernel, nbytes, cold, rounds, pool, args.threads)
            raw = got["raw copy"]
            print(f"{mib:g} MiB, {'cold' if cold else 'hot'} destination: "
                  + "; ".join(f"{name} {v:.1f} ({v / raw:.2f})" for name, v in got.items()))
            rows.append({"mib": mib, "destination": "cold" if cold else "hot", "gbps": got})
    print(f"load average {os.getloadavg()[0]:.1f} after")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
