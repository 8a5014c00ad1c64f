"""CRC32C of a block from the CRC32Cs of its pieces, without reading the bytes again.

A KV block of a layer-major pool is ``2 * num_layers`` chunks scattered over the pool; a one-pass gather takes a
CRC32C per chunk as it copies it (`copy_rows_crc32c`), and the block's CRC32C follows from those alone:

    crc(A + B) = zeros(len(B))(crc(A)) ^ crc(B)

where ``zeros(n)`` is the linear map (over GF(2)) that runs the CRC register over n zero bytes (zlib's
``crc32_combine``, for the Castagnoli polynomial). Each map is held as four 256-entry tables (one per byte of its
input), so applying it to an array of CRCs is four numpy gathers; pieces are combined pairwise, in a tree, so a
block of k pieces costs ``log2(k)`` vectorized steps whatever the number of blocks.
"""

from __future__ import annotations

import functools

import crc32c
import numpy as np

_BITS = np.arange(32, dtype=np.uint32)


@functools.cache
def _zeros_tables(length: int) -> np.ndarray:
    """``[4, 256]`` uint32: entry ``[b, v]`` is zeros(length)(v << 8 b)."""
    if length == 1:
        base = crc32c.crc32c(b"\0")
        columns = np.array([crc32c.crc32c(b"\0", 1 << j) ^ base for j in range(32)], dtype=np.uint32)
    else:  # zeros(a + b) = zeros(a) after zeros(b), by the binary digits of `length`
        half = 1 << (length.bit_length() - 1)
        rest = length - half
        first = _zeros_tables(half // 2 if rest == 0 else half)
        second = _zeros_tables(half // 2 if rest == 0 else rest)
        columns = _apply(second, _apply(first, (1 << _BITS).astype(np.uint32)))
    # the map is linear: its value at v is the XOR of its columns at v's set bits, tabulated a byte at a time
    values = np.arange(256, dtype=np.uint32)
    tables = np.zeros((4, 256), dtype=np.uint32)
    for b in range(4):
        for j in range(8):
            tables[b] ^= np.where((values >> j) & 1, columns[8 * b + j], 0).astype(np.uint32)
    return tables


def _apply(tables: np.ndarray, crcs: np.ndarray) -> np.ndarray:
    """The map `tables` holds, at each of `crcs` (uint32, any shape)."""
    return (tables[0][crcs & 0xFF] ^ tables[1][(crcs >> 8) & 0xFF] ^ tables[2][(crcs >> 16) & 0xFF]
            ^ tables[3][crcs >> 24])


def concat_crcs(crcs: np.ndarray, piece_bytes: int) -> np.ndarray:
    """``[n]`` uint32: the CRC32C of each row's pieces put end to end, from ``crcs: [n, k]`` (the CRC32C of each
    piece, in order; every piece `piece_bytes` long), as the `crc32c` package would give for the whole row."""
    crcs = np.asarray(crcs, dtype=np.uint32)
    length = piece_bytes  # of every column but, after an odd level, the last (`tail`)
    tail = piece_bytes
    while crcs.shape[1] > 1:
        k = crcs.shape[1]
        pairs = k // 2
        left, right = crcs[:, 0 : 2 * pairs : 2], crcs[:, 1 : 2 * pairs : 2]
        joined = _apply(_zeros_tables(length), left)
        if k % 2 == 0 and tail != length:  # the last pair's right piece is the short tail
            joined[:, -1] = _apply(_zeros_tables(tail), left[:, -1])
        joined ^= right
        if k % 2:  # the odd piece out moves up alone, as the new tail
            crcs = np.concatenate((joined, crcs[:, -1:]), axis=1)
        else:
            crcs = joined
            tail = length + tail
        length *= 2
    return crcs[:, 0]
