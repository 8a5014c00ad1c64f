"""Raw disk I/O modes under the disk tier, side by side: buffered pwritev / preadv against O_DIRECT with aligned
buffers, each at queue depth 1 and with a thread pool (queue depth = threads), on the same bytes and file.

    python bench/tiers_io.py --mib 64 --json out/tiers_io.json

Writes go in `--piece-kib` pieces to one preallocated file; "write + fsync" waits for the device too. Reads:
"warm" reads what the page cache holds (just written), "cold" first drops the file's pages
(posix_fadvise DONTNEED after an fsync), O_DIRECT never uses the cache. This is the measurement that picks the
disk tier's I/O mode; the tier itself is measured in `bench/tiers_raw.py`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

ALIGN = 4096


def aligned(nbytes: int) -> memoryview:
    """A page-aligned buffer (anonymous mmap), as O_DIRECT needs."""
    return memoryview(mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN))


def run_pieces(fn, pieces: list[int], depth: int, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    if depth == 1:
        for offset in pieces:
            fn(offset)
    else:
        list(pool.map(fn, pieces))


def measure_io(path: Path, total: int, piece: int, repeats: int, depths: tuple[int, ...]) -> list[dict]:
    pieces = list(range(0, total, piece))
    data = aligned(total)
    data[:] = os.urandom(total)
    out = aligned(total)
    rows: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(max(depths))
    modes = {"buffered": os.O_RDWR, "O_DIRECT": os.O_RDWR | getattr(os, "O_DIRECT", 0)}
    setup_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(setup_fd, data, 0)
    os.fsync(setup_fd)
    for mode, flags in modes.items():
        if mode == "O_DIRECT" and not hasattr(os, "O_DIRECT"):
            continue
        fd = os.open(path, flags)

        def write(offset: int, fd: int = fd) -> None:
            os.pwrite(fd, data[offset : offset + piece], offset)

        def read(offset: int, fd: int = fd) -> None:
            os.preadv(fd, [out[offset : offset + piece]], offset)

        def drop_cache() -> None:
            os.fsync(setup_fd)
            os.posix_fadvise(setup_fd, 0, total, os.POSIX_FADV_DONTNEED)

        for depth in depths:
            cases = {"write": (write, None, False), "write + fsync": (write, None, True),
                     "read warm": (read, lambda: run_pieces(write, pieces, 1, pool), False),
                     "read cold": (read, drop_cache, False)}
            for op, (fn, setup, sync) in cases.items():
                if mode == "O_DIRECT" and op == "read warm":
                    continue  # (no cache to be warm)
                best = float("inf")
                for i in range(repeats + 1):
                    if setup is not None:
                        setup()
                    start = time.perf_counter()
                    run_pieces(fn, pieces, depth, pool)
                    if sync:
                        os.fsync(fd)
                    if i:
                        best = min(best, time.perf_counter() - start)
                rows.append({"mode": mode, "op": op, "depth": depth, "gb_s": total / best / 1e9})
        os.close(fd)
    os.close(setup_fd)
    pool.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="bytes per pass")
    parser.add_argument("--piece-kib", type=int, default=1024, help="bytes per pwrite / preadv")
    parser.add_argument("--depths", default="1,2,4", help="queue depths (threads) to try")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    depths = tuple(int(d) for d in args.depths.split(","))
    with tempfile.TemporaryDirectory(prefix="sage-tiers-io-", dir=args.dir) as work:
        rows = measure_io(Path(work) / "io.bin", args.mib << 20, args.piece_kib << 10, args.repeats, depths)
    print(f"{args.mib} MiB in {args.piece_kib} KiB pieces, best of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'mode':<9} {'op':<14} {'depth':>5} {'GB/s':>7}")
    for r in rows:
        print(f"{r['mode']:<9} {r['op']:<14} {r['depth']:>5} {r['gb_s']:>7.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mib": args.mib, "piece_kib": args.piece_kib, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
