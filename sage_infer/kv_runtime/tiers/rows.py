"""Moving KV block rows in bulk: runs of consecutive rows, one copy per run, one CRC32C per row.

A tier moves whole blocks, ``[n, bytes_per_block]`` uint8 rows, between a caller's buffer
and its own (the host tier's slab, the disk tier's queue). The costs a small block pays
are per-row Python work and per-row calls, so everything here works on *runs*: rows that
are consecutive on both sides go in one copy. Where the KV codec's C++ kernel loads, a checked
move is one call for the whole batch that copies and checksums in one pass (`copy_rows_crc32c`:
each byte loaded once, stored, and folded into the CRC; the GIL released); elsewhere
checksums are taken right after each ~1 MiB piece is copied, while it is still in cache. A large
move (`PARALLEL_MIN_BYTES` or more, of rows that are checksummed with the GIL released) is split
into pieces that a small thread pool moves in parallel (`bench/tiers_raw.py`, "threads" rows).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

import crc32c
import numpy as np
import torch

CACHE_CHUNK = 1 << 20  # copy this much, then checksum it while it is still in cache
# crc32c checksums a buffer at least this large with the GIL released (its default mode); smaller rows hold
# the GIL, so two threads only take turns
GIL_FREE_ROW_BYTES = 32 << 10
PARALLEL_MIN_BYTES = 4 << 20  # below this, handing pieces to threads costs more than it saves
# One thread per 4 cores, at most 4: a core or two do not saturate a big host's memory, but on a small machine
# every core is the engine's (or a neighbour's) already, and copy threads only steal from it: on the 2-vCPU VM
# two threads measured slower than one whenever anything else ran (`bench/tiers_raw.py --threads 2`), and host-tier
# reads split over two threads of the loader thread's OpenMP team (whose second thread spins on after the copy)
# took a 4K-token load's TTFT from 22 to 31 ms (`bench/load_vs_recompute.py`, Xeon VM)
MOVE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))

Run = tuple[int, int, int]  # (destination row, source row, rows)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_kernel: ModuleType | None | bool = False  # False: not looked up yet
_pool_lock = threading.Lock()


def set_move_threads(threads: int) -> None:
    """How many threads split a large move (1: none); takes effect for the next move."""
    global MOVE_THREADS, _pool
    if threads < 1:
        raise ValueError(f"move threads must be >= 1, got {threads}")
    with _pool_lock:
        MOVE_THREADS = threads
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)


def move_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's row-moving threads (shared by every tier, started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(MOVE_THREADS, thread_name_prefix="sage-kv-rows")
        return _pool


def fused_kernel() -> ModuleType | None:
    """The C++ kernel whose ``copy_rows_crc32c`` copies a batch of rows and checksums each in one pass, with the
    GIL released (`quantization.kv_codec_kernel.fused_copy`), or None where it does not load (then a numpy copy
    and the crc32c package: two passes)."""
    global _kernel
    if _kernel is False:
        from sage_infer.quantization.kv_codec_kernel import fused_copy

        _kernel = fused_copy()
    return _kernel


def runs_of(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[Run]:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` as runs consecutive on both sides (in order)."""
    n = len(dst_rows)
    if n > 32 and consecutive(dst_rows) and consecutive(src_rows):  # (the usual batch: one run, found in C)
        return [(dst_rows[0], src_rows[0], n)]
    if n > 32:  # (numpy finds the breaks of a long batch faster than a Python loop)
        d, s = np.asarray(dst_rows, dtype=np.int64), np.asarray(src_rows, dtype=np.int64)
        breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
        starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [n]))
        return list(zip(d[starts].tolist(), s[starts].tolist(), (ends - starts).tolist()))
    out: list[Run] = []
    i = 0
    while i < n:
        d, s = dst_rows[i], src_rows[i]
        j = i + 1
        while j < n and dst_rows[j] == d + (j - i) and src_rows[j] == s + (j - i):
            j += 1
        out.append((d, s, j - i))
        i = j
    return out


def consecutive(rows: Sequence[int]) -> bool:
    """Whether `rows` is r, r + 1, r + 2, ... (a range, or a list equal to one)."""
    if isinstance(rows, range):
        return rows.step == 1
    return rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[0] + len(rows)))


def pieces(runs: list[Run], rows_per_piece: int) -> list[Run]:
    """`runs` cut into pieces of at most `rows_per_piece` rows."""
    out: list[Run] = []
    for d, s, n in runs:
        for k in range(0, n, rows_per_piece):
            out.append((d + k, s + k, min(rows_per_piece, n - k)))
    return out


def crc_rows(rows: np.ndarray, release_gil: bool = False) -> list[int]:
    """CRC32C of each row of a 2-D uint8 array. `release_gil`: even for rows too small for crc32c to release it
    on its own, so a thread working beside the engine's (the disk writer, a loader, the host tier's checksummer)
    never keeps it for a switch interval while the engine thread waits for it."""
    if release_gil:
        return list(map(_crc_releasing, rows))
    return list(map(crc32c.crc32c, rows))


_crc_releasing = functools.partial(crc32c.crc32c, gil_release_mode=1)


def parallel(row_bytes: int, total_bytes: int, crc: bool = True, threads: int | None = None) -> bool:
    """Whether a move of `total_bytes` in rows of `row_bytes` splits over `threads` (default `MOVE_THREADS`; rows
    too small for crc32c to release the GIL are checksummed on one thread)."""
    gil_free = row_bytes >= GIL_FREE_ROW_BYTES or not crc
    return (threads or MOVE_THREADS) > 1 and gil_free and total_bytes >= PARALLEL_MIN_BYTES


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[Run], crc_of: str | None = None,
              release_gil: bool = False, threads: int | None = None, spawn: bool = False) -> list[int]:
    """Copy `runs` of rows from `src` to `dst` (2-D uint8, CPU); with `crc_of` ("dst" or "src") also the CRC32C
    of each copied row, in run order, taken while the piece is in cache.

    Both sides' rows must be `bytes_per_block` wide. The pieces of a large move run on the thread pool.
    `release_gil`: a call off the engine thread (see `crc_rows`; the one-pass kernel always releases it).
    `threads`: how many the one-pass kernel may split a large move over (default `MOVE_THREADS`), `spawn`: on
    threads started for the call rather than the caller's OpenMP team (a thread beside the engine's: the host
    tier's reads on the loader thread, whose own team's threads spin on after a region, on the engine's cores: a
    4K-token load's TTFT 22 -> 31 ms over two of them on the 2-vCPU Xeon VM); without the kernel, the pieces go
    to the `MOVE_THREADS` pool.
    """
    row_bytes = dst.shape[1]
    rows_per_piece = max(1, CACHE_CHUNK // max(1, row_bytes))
    total = sum(n for _, _, n in runs) * row_bytes
    dst_np, src_np = dst.numpy(), src.numpy()
    check = dst_np if crc_of == "dst" else src_np

    def piece(run: Run) -> list[int]:
        d, s, n = run
        # numpy, not torch: one thread per copy, the GIL released; torch's OpenMP threads stall whenever
        # any other thread wants a core (`bench/tiers.py`, "Threads")
        np.copyto(dst_np[d : d + n], src_np[s : s + n])
        return crc_rows(check[d : d + n] if crc_of == "dst" else check[s : s + n], release_gil) if crc_of else []

    kernel = fused_kernel() if crc_of and dst.stride(1) == 1 and src.stride(1) == 1 else None
    if kernel is not None:  # one pass: each row checksummed as it is copied (the CRC of the bytes both sides hold)
        # (split over MOVE_THREADS inside the kernel: one range of rows per thread, none handed through Python)
        threads = threads or MOVE_THREADS
        return fused_rows(kernel, dst, src, runs, threads if parallel(row_bytes, total, False, threads) else 1, spawn)
    if parallel(row_bytes, total, crc=crc_of is not None):
        done = move_pool().map(piece, pieces(runs, rows_per_piece if crc_of else max(rows_per_piece, len_per_thread(
            total, row_bytes))))
        return [crc for part in done for crc in part]
    return [crc for run in (pieces(runs, rows_per_piece) if crc_of else runs) for crc in piece(run)]


def fused_rows(kernel: ModuleType, dst: torch.Tensor, src: torch.Tensor, runs: list[Run], threads: int = 1,
               spawn: bool = False) -> list[int]:
    """`copy_runs` with checksums in one kernel call (one pass over the bytes, the GIL released), its rows split
    over `threads` (`spawn`: started for the call)."""
    return kernel.copy_rows_crc32c(dst, src, torch.tensor(runs, dtype=torch.long).reshape(-1, 3),
                                   threads=threads, spawn=spawn).tolist()


def len_per_thread(total_bytes: int, row_bytes: int) -> int:
    """Rows per piece when a plain copy is split evenly over the threads."""
    return max(1, -(-total_bytes // (MOVE_THREADS * row_bytes)))


def crc_runs(array: torch.Tensor, runs: list[tuple[int, int]]) -> list[int]:
    """CRC32C of each row in `runs` of (first row, rows) of a 2-D uint8 CPU tensor, in order."""
    row_bytes = array.shape[1]
    arr = array.numpy()
    total = sum(n for _, n in runs) * row_bytes
    if not parallel(row_bytes, total):
        return [crc for s, n in runs for crc in crc_rows(arr[s : s + n])]
    rows_per_piece = max(1, CACHE_CHUNK // row_bytes)
    split = [(s + k, min(rows_per_piece, n - k)) for s, n in runs for k in range(0, n, rows_per_piece)]
    done = move_pool().map(lambda run: crc_rows(arr[run[0] : run[0] + run[1]]), split)
    return [crc for part in done for crc in part]


Gather = Callable[[list[int], torch.Tensor], None]


class ChunkGather:
    """A `Gather` whose batch rows are each made of equal chunks of one source: row i is the source's rows
    ``index[i]`` end to end (a layer-major KV pool's block is its 2 x num_layers (layer, K/V) chunks,
    `KVPool.block_chunks`). Called, it copies (`copy`: the plain gather); `gather_crc` also checksums each row in
    the same pass where the one-pass kernel loads: a CRC32C per chunk as it is copied, then the row's from those
    (`crc_concat`), so the gathered bytes are never read again.

    `source`: ``[R, chunk_bytes]`` uint8 CPU (each row contiguous); `index`: ``[n, k]`` int64 source rows;
    `threads`: how many a large `gather_crc` may split over (default `MOVE_THREADS`)."""

    def __init__(self, source: torch.Tensor, index: np.ndarray, copy: Gather, threads: int | None = None) -> None:
        self.source, self.index, self.copy, self.threads = source, index, copy, threads

    def __call__(self, rows: list[int], out: torch.Tensor) -> None:
        self.copy(rows, out)

    def gather_crc(self, rows: Sequence[int], out: torch.Tensor, threads: int | None = None) -> np.ndarray | None:
        """``out[j] = row rows[j]`` and the CRC32C of each (uint32 ``[len(rows)]``) in one pass; None, copying
        nothing, where the kernel does not load. `out`: ``[len(rows), k * chunk_bytes]`` uint8 CPU whose rows are
        contiguous (any row stride: a record's payload after its header). `threads` overrides the gather's own."""
        from sage_infer.kv_runtime.tiers.crc_concat import concat_crcs

        kernel = fused_kernel()
        if kernel is None or out.stride(1) != 1 or not len(rows):
            return None
        index = self.index if len(rows) == len(self.index) and consecutive(rows) and rows[0] == 0 else (
            self.index[np.asarray(rows, dtype=np.int64)])
        m, k = index.shape
        chunk = self.source.shape[1]
        # out's chunk (j, p) starts p * chunk bytes into row j: one destination "row" per byte offset, so the
        # kernel can address chunks whatever out's row stride
        at = (np.arange(m, dtype=np.int64)[:, None] * out.stride(0) + np.arange(k, dtype=np.int64) * chunk)
        span = (m - 1) * out.stride(0) + k * chunk
        dst = out.as_strided((span - chunk + 1, chunk), (1, 1))
        runs = np.stack((at.reshape(-1), index.reshape(-1), np.ones(m * k, dtype=np.int64)), axis=1)
        threads = threads or self.threads or MOVE_THREADS
        threads = threads if parallel(chunk, m * k * chunk, False, threads) else 1
        crcs = kernel.copy_rows_crc32c(dst, self.source, torch.from_numpy(runs), threads=threads).numpy()
        return concat_crcs(crcs.astype(np.uint32).reshape(m, k), chunk)


def tensor_gather(blocks: torch.Tensor) -> Gather:
    """A `Gather` over the rows of a ``[n, bytes_per_block]`` uint8 tensor: one copy per run of rows."""

    def gather(rows: list[int], out: torch.Tensor) -> None:
        if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[0] + len(rows))):
            if blocks.device.type == "cpu" and out.device.type == "cpu":
                copy_runs(out, blocks, [(0, rows[0], len(rows))])
            else:
                out.copy_(blocks[rows[0] : rows[0] + len(rows)])
        elif blocks.device == out.device:
            torch.index_select(blocks, 0, torch.tensor(rows, dtype=torch.long, device=blocks.device), out=out)
        else:
            out.copy_(blocks.index_select(0, torch.tensor(rows, dtype=torch.long, device=blocks.device)))

    return gather
