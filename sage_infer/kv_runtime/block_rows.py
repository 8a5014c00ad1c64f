"""Whole KV blocks in and out of a layer-major pool with one gather / one scatter, on a CPU.

A pool stores ``[2, num_layers, num_blocks, *chunk]``: block ``b`` is ``2 * num_layers`` chunks, one per
(K/V, layer), each ``block_size * num_kv_heads * head_dim`` elements. Viewed as bytes, the storage is
``[2 * num_layers * num_blocks, chunk_bytes]`` rows, and a block's row format (``[num_layers, 2, *chunk]``)
is those rows in (layer, K/V) order. So moving n blocks is one numpy gather (``np.take``) or one fancy
assignment over ``n * 2 * num_layers`` row indices, straight between the pool and a contiguous buffer:
no temporary, no permuted copy, and no OpenMP team (torch's ``index_select`` + permute ran it through
two copies and two parallel regions, which stall whenever another thread wants a core on a small
machine; `bench/tiers_raw.py`, "pool gather").
"""

from __future__ import annotations

import numpy as np
import torch


def chunk_rows(storage: torch.Tensor) -> np.ndarray | None:
    """`storage` (``[2, L, N, ...]``, contiguous, on the CPU) as bytes ``[2 * L * N, chunk_bytes]``; None when
    it is not one contiguous CPU tensor (then the caller takes the torch path)."""
    if storage.device.type != "cpu" or not storage.is_contiguous():
        return None
    rows = storage.shape[0] * storage.shape[1] * storage.shape[2]
    return storage.view(torch.uint8).view(rows, -1).numpy()


def block_row_index(block_ids: torch.Tensor, num_layers: int, num_blocks: int) -> np.ndarray:
    """The byte rows of blocks `block_ids`, ``[n * num_layers * 2]`` in block-row order (block, layer, K/V)."""
    ids = block_ids.cpu().numpy().astype(np.int64, copy=False).reshape(-1, 1, 1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise IndexError(f"block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}")
    layer = np.arange(num_layers, dtype=np.int64).reshape(1, num_layers, 1) * num_blocks
    kv = np.arange(2, dtype=np.int64).reshape(1, 1, 2) * (num_layers * num_blocks)
    return (ids + layer + kv).reshape(-1)


def byte_rows(tensor: torch.Tensor, rows: int) -> np.ndarray | None:
    """A contiguous CPU tensor's bytes as ``[rows, -1]``; None otherwise."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return tensor.view(torch.uint8).view(rows, -1).numpy()


def engine_move_threads() -> int:
    """Threads a pool copy may split over where the engine thread waits for it (admitting a load): torch's
    intra-op threads, idle until the copy returns."""
    return torch.get_num_threads()


KERNEL_MIN_BYTES = 256 << 10  # moves this large take the C++ row copy (smaller ones: numpy, no runs to build)


def kernel_copy(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray, threads: int = 1
                ) -> bool:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for 2-D byte arrays, one C++ call (the fused row copy of
    `tiers.rows.fused_kernel`, its checksums unused), its rows split over `threads`: measured 1.7x numpy's
    fancy-indexed assignment for a 16K-token load of 8 KiB chunks (9.0 against 15.1 ms for 96 MiB on the Xeon
    VM, one thread). False where the kernel does not load, the move is small, or a side is not rows of contiguous
    bytes (the caller copies with numpy)."""
    if dst_rows.size * dst.shape[1] < KERNEL_MIN_BYTES or dst.strides[1] != 1 or src.strides[1] != 1:
        return False
    from sage_infer.kv_runtime.tiers.rows import fused_kernel

    kernel = fused_kernel()
    if kernel is None:
        return False
    runs = np.stack((dst_rows, src_rows, np.ones_like(dst_rows)), axis=1)
    kernel.copy_rows_crc32c(torch.from_numpy(dst), torch.from_numpy(src), torch.from_numpy(runs), threads=threads)
    return True


def flat_rows(blocks: np.ndarray) -> np.ndarray | None:
    """A ``[n, 2 * L, chunk_bytes]`` view as ``[n * 2 * L, chunk_bytes]`` rows, None when its strides do not allow it
    (a strided part of wider rows)."""
    if blocks.strides[0] != blocks.shape[1] * blocks.strides[1]:
        return None
    return np.lib.stride_tricks.as_strided(blocks, (blocks.shape[0] * blocks.shape[1], blocks.shape[2]),
                                           blocks.strides[1:])


def take_blocks(storage: torch.Tensor, block_ids: torch.Tensor, dst: np.ndarray) -> bool:
    """``dst[i] = block block_ids[i]``'s chunks of `storage`, with `dst` a bytes view ``[n, 2 * L, chunk_bytes]``
    (it may be a strided part of wider rows, as a quantized pool's codes before its scales); False when `storage`
    is not one contiguous CPU tensor (nothing was copied)."""
    src = chunk_rows(storage)
    if src is None:
        return False
    index = block_row_index(block_ids, storage.shape[1], storage.shape[2]).reshape(dst.shape[0], -1)
    rows = flat_rows(dst)
    if rows is not None and kernel_copy(rows, np.arange(index.size), src, index.reshape(-1)):
        return True
    if dst.flags.c_contiguous:
        np.take(src, index, axis=0, out=dst, mode="clip")  # (ids are checked: "clip" skips a buffered check)
    else:  # (a strided part of wider rows: numpy's own buffering of `out` measured several times slower)
        np.copyto(dst, np.take(src, index, axis=0, mode="clip"))
    return True


def put_blocks(storage: torch.Tensor, block_ids: torch.Tensor, src: np.ndarray, threads: int = 1) -> bool:
    """Block ``block_ids[i]``'s chunks of `storage` = ``src[i]`` (distinct ids; `src` as `take_blocks`' `dst`),
    a large move split over `threads`; False when `storage` is not one contiguous CPU tensor (nothing was
    copied)."""
    dst = chunk_rows(storage)
    if dst is None:
        return False
    index = block_row_index(block_ids, storage.shape[1], storage.shape[2])
    rows = flat_rows(src)
    if rows is None or not kernel_copy(dst, index, rows, np.arange(index.size), threads):
        dst[index.reshape(src.shape[0], -1)] = src
    return True


def gather_blocks(storage: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> bool:
    """``out[i] = block block_ids[i]`` (rows in the block format) with one gather; False when `storage` or `out`
    is not a contiguous CPU tensor (nothing was copied)."""
    if block_ids.numel() == 0:
        return out.device.type == "cpu"  # (nothing to copy)
    rows = byte_rows(out, block_ids.numel())
    return rows is not None and take_blocks(storage, block_ids, rows.reshape(rows.shape[0], 2 * storage.shape[1], -1))


def scatter_blocks(storage: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor, threads: int = 1) -> bool:
    """Block ``block_ids[i]`` = ``src[i]`` (distinct ids) with one scatter (a large one split over `threads`);
    False when `storage` or `src` is not a contiguous CPU tensor (nothing was copied)."""
    if block_ids.numel() == 0:
        return storage.device.type == "cpu"  # (nothing to copy)
    rows = byte_rows(src, block_ids.numel())
    return rows is not None and put_blocks(storage, block_ids, rows.reshape(rows.shape[0], 2 * storage.shape[1], -1),
                                           threads)
