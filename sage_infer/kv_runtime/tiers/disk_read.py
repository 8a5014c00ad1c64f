"""Reading a batch of disk-tier records into a caller's rows: grouped, copied and verified with no Python per record.

A batch's records are looked up once (`DiskTier._load`), then planned here as arrays: the records that sit next to
each other in one segment form a *group* (numpy sorts them into file order and finds the breaks), whichever rows of
the caller's buffer they go to, and each group is one read. File order matters: a chain is demoted leaf first, so
its records often lie in the reverse of the order a load asks for them, and planned by batch order each record
would be a mapping of its own (a 16K-token load of 96 KiB blocks written in reverse: 46 ms, against 16 ms in file
order on the Xeon VM). Where the one-pass copy + CRC kernel loads, a group's span of the segment is mapped (the
page cache's own pages) and the kernel copies each payload into its row and checksums it in the same pass
(`copy_rows_crc32c`), so each byte is read once; elsewhere one `preadv` lands the payloads in the rows (the headers
between them in a scratch buffer), then `crc32c` per row. The verdicts are one vector comparison against the
stored CRCs.
"""

from __future__ import annotations

import mmap
import operator
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from sage_infer.kv_runtime.tiers.rows import CACHE_CHUNK, crc_rows, move_pool, parallel
from sage_infer.kv_runtime.tiers.segment import HEADER, Segment

MiB = 1 << 20
# bytes of adjacent records mapped at once, their pages faulted in by the copy (1 MiB: 0.43 of a preadv at 256 KiB
# blocks, 8 MiB: 0.95; mapping with MAP_POPULATE: 0.30)
MAP_GROUP = 8 * MiB

_SEGMENT, _OFFSET, _CRC = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)


@dataclass(slots=True)
class Group:
    """`count` records of `segment` back to back from `offset`, in file order: record j goes to row ``rows[j]`` of
    the caller's rows and is record ``members[j]`` of the batch."""

    segment: Segment
    offset: int  # of the first record's header
    rows: np.ndarray
    members: np.ndarray

    @property
    def count(self) -> int:
        return len(self.members)


def plan(rows: np.ndarray, locs: Sequence[tuple], record_bytes: int, per_group: int) -> list[Group]:
    """The groups that read records `locs` (``(segment, header offset, crc)`` each) into `rows` (distinct), each at
    most `per_group` records back to back in one segment."""
    n = len(locs)
    if n == 0:
        return []
    offsets = np.fromiter(map(_OFFSET, locs), dtype=np.int64, count=n)
    segments = list(map(_SEGMENT, locs))
    seg_ids = np.fromiter(map(id, segments), dtype=np.int64, count=n)
    order = np.lexsort((offsets, seg_ids))  # file order within each segment
    offsets, seg_ids, rows = offsets[order], seg_ids[order], np.asarray(rows, dtype=np.int64)[order]
    breaks = np.flatnonzero((np.diff(offsets) != record_bytes) | (np.diff(seg_ids) != 0)) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    groups = []
    for start, end in zip(starts, ends):
        for first in range(start, end, per_group):
            last = min(end, first + per_group)
            groups.append(Group(segments[int(order[first])], int(offsets[first]), rows[first:last],
                                order[first:last]))
    return groups


def read_batch(locs: Sequence[tuple], rows: np.ndarray, out: torch.Tensor, kernel: ModuleType | None,
               bytes_per_block: int) -> tuple[np.ndarray, np.ndarray]:
    """Read the payloads of records `locs` into ``out[rows]`` and verify them: (ok, io_error), bool ``[len(locs)]``.

    A record the file no longer holds to its end reads as not ok (a short read); a group whose read fails is an
    I/O error. A large read's groups run on the row threads (queue depth > 1) where there are any."""
    n = len(locs)
    record = HEADER.size + bytes_per_block
    # (a mapped group has no cache to stay in: larger groups, fewer mappings)
    per = max(1, (MAP_GROUP if kernel is not None else CACHE_CHUNK) // record)
    groups = plan(rows, locs, record, per)
    # a large read streams its stores (into rows not in cache) even where each group is under the kernel's own
    # threshold
    stream = 1 if kernel is not None and n * bytes_per_block >= kernel.copy_stream_min_bytes() else 0

    def read(group: Group) -> tuple[np.ndarray | None, int]:
        if kernel is not None:
            return _read_mapped(kernel, group, out, bytes_per_block, stream)
        return _read_preadv(group, out, bytes_per_block)

    if parallel(bytes_per_block, n * bytes_per_block) and len(groups) > 1:
        done = list(move_pool().map(read, groups))
    else:
        done = [read(group) for group in groups]
    got = np.zeros(n, dtype=np.uint32)
    held = np.zeros(n, dtype=bool)  # read to its end
    io_error = np.zeros(n, dtype=bool)
    for group, (crcs, whole) in zip(groups, done):
        if crcs is None:
            io_error[group.members] = True
        else:
            got[group.members[:whole]] = crcs
            held[group.members[:whole]] = True
    expected = np.fromiter(map(_CRC, locs), dtype=np.uint32, count=n)
    return held & (got == expected), io_error


def _consecutive(rows: np.ndarray) -> bool:
    """Whether a group's rows are ``r, r + 1, ...`` (one slice of the caller's rows), not another order."""
    return not (np.diff(rows) != 1).any()


def _whole(segment: Segment, offset: int, count: int, record: int) -> int:
    """How many of `count` records from `offset` the segment's file holds to their end (fstat: the file may have
    been cut under the tier)."""
    size = os.fstat(segment.fd).st_size
    return max(0, min(count, (size - offset) // record))


def _read_mapped(kernel: ModuleType, group: Group, out: torch.Tensor, bpb: int, stream: int
                 ) -> tuple[np.ndarray | None, int]:
    """One group in one pass: its span of the segment mapped (the page cache's own pages, no copy), each payload
    copied into its row and checksummed as it is copied. (CRCs of the records held whole, how many) or (None, 0)
    on an I/O error."""
    record = HEADER.size + bpb
    start = group.offset + HEADER.size  # the first payload; payload j starts j records later
    try:
        whole = _whole(group.segment, group.offset, group.count, record)
        if whole == 0:
            return np.zeros(0, dtype=np.uint32), 0
        base = start - start % mmap.ALLOCATIONGRANULARITY
        span = start - base + (whole - 1) * record + bpb
        mapped = mmap.mmap(group.segment.fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base)
    except OSError:
        return None, 0
    try:
        with warnings.catch_warnings():  # (torch warns that the read-only mapping is shared; it is only read)
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))
        src = flat.as_strided((whole, bpb), (record, 1), start - base)
        rows = group.rows[:whole]
        if _consecutive(rows):
            crcs = kernel.copy_rows_crc32c(out[int(rows[0]) : int(rows[0]) + whole], src,
                                           torch.tensor([[0, 0, whole]]), stream)
        else:  # each record into its own row
            runs = torch.from_numpy(np.stack((rows, np.arange(whole), np.ones(whole, dtype=np.int64)), axis=1))
            crcs = kernel.copy_rows_crc32c(out, src, runs, stream)
        del flat, src
    finally:
        mapped.close()
    return crcs.numpy().astype(np.uint32), whole


def _read_preadv(group: Group, out: torch.Tensor, bpb: int) -> tuple[np.ndarray | None, int]:
    """One group with one preadv straight into its rows (the headers between payloads into a scratch buffer),
    then the CRC32C of each row while it is in cache."""
    out_np = out.numpy()
    rows = group.rows
    scratch = bytearray(HEADER.size)
    buffers: list = []
    for j, row in enumerate(rows):
        buffers += ([scratch] if j else []) + [out_np[row]]
    try:
        got = os.preadv(group.segment.fd, buffers, group.offset + HEADER.size)
    except OSError:
        return None, 0
    whole = min(len(rows), (got + HEADER.size) // (HEADER.size + bpb))  # records read to their end (a short read stops)
    # (releasing the GIL: a loader thread, mostly)
    if _consecutive(rows[:whole]):
        first = int(rows[0]) if whole else 0
        return np.array(crc_rows(out_np[first : first + whole], release_gil=True), dtype=np.uint32), whole
    return np.array([crc for row in rows[:whole] for crc in crc_rows(out_np[row : row + 1], release_gil=True)],
                    dtype=np.uint32), whole
