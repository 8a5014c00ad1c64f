"""Host copy bandwidth: the torch copy the probe and host KV tier use, against raw
numpy memcpy measured in the same run.

    python bench/host_copy.py --sizes 1MiB,16MiB,256MiB --json out/host_copy.json

Prints a table (GB/s and ratio to numpy) and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import ByteSize, TypeAdapter


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm: fault pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(size: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    src_t = torch.ones(size, dtype=torch.uint8)
    dst_t = torch.empty_like(src_t)
    src_n = np.ones(size, dtype=np.uint8)
    dst_n = np.empty_like(src_n)
    torch_s = best_seconds(lambda: dst_t.copy_(src_t), repeats)
    numpy_s = best_seconds(lambda: np.copyto(dst_n, src_n), repeats)
    return {
        "bytes": size,
        "torch_threads": threads,
        "torch_gb_s": size / torch_s / 1e9,
        "numpy_memcpy_gb_s": size / numpy_s / 1e9,
        "ratio_to_memcpy": numpy_s / torch_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1MiB,16MiB,256MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", default="1,all")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in args.sizes.split(",")]
    all_threads = torch.get_num_threads()
    threads = sorted({all_threads if t == "all" else int(t) for t in args.threads.split(",")})
    results = [measure(size, args.repeats, t) for size in sizes for t in threads]
    print(f"{'size':>10} {'threads':>7} {'torch GB/s':>11} {'memcpy GB/s':>12} {'ratio':>6}")
    for r in results:
        print(f"{r['bytes'] / 2**20:>8.0f}Mi {r['torch_threads']:>7} {r['torch_gb_s']:>11.2f} "
              f"{r['numpy_memcpy_gb_s']:>12.2f} {r['ratio_to_memcpy']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
