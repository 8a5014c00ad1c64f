"""`DiskTier`: KV blocks in append-only segment files under one directory, with a size cap.

- Writes go through one background writer thread: `put` copies the rows into memory and
  queues them (bounded by `max_pending_bytes`; a full queue drops the batch's tail and counts
  it), so the engine never waits for the disk. Queued blocks are readable at once.
- An in-memory index ``key -> (segment, offset, length, crc)`` is rebuilt at start-up by
  reading every record header (format in `segment.py`); records of another schema, and a
  torn record at a segment's end, are skipped and counted in `skipped_records`.
- Reads go from a kept-open fd: where the one-pass copy + CRC kernel loads, a run of records is mapped
  (mmap of the page cache's pages) and copied into the caller's rows and checksummed in one pass, each byte
  read once (`bench/tiers_raw.py`: faster than a preadv alone); elsewhere `os.preadv` straight into the
  caller's rows, then CRC32C.
- Eviction is FIFO by write time, a segment at a time: when the next record would pass the
  cap, the oldest segment's file is removed (its blocks count as evictions).
- Deletes mark records dead (on disk too); `compact()` rewrites the live records of the most
  fragmented segments at the end and removes them. Compacted blocks count as newly written.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import crc32c
import numpy as np
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers.base import KVTier
from sage_infer.kv_runtime.tiers.rows import (
    CACHE_CHUNK,
    Gather,
    copy_runs,
    crc_rows,
    fused_kernel,
    move_pool,
    parallel,
    runs_of,
    tensor_gather,
)
from sage_infer.kv_runtime.tiers.segment import HEADER, Segment, encode_header, segment_paths
from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError, TierError

MiB = 1 << 20
_IOV_MAX = 512  # buffers per pwritev (Linux allows 1024; two per record)
# bytes per pwritev: fewer, larger writes measured faster for small records than ~1 MiB pieces checksummed in cache
WRITE_PIECE = 4 * MiB
# bytes of adjacent records mapped at once, their pages faulted in by the copy (1 MiB: 0.43 of a preadv at 256 KiB
# blocks, 8 MiB: 0.95; mapping with MAP_POPULATE: 0.30)
MAP_GROUP = 8 * MiB
# False: reads take the two-pass path (preadv into the caller's rows, then their CRC32C) even where the one-pass
# kernel loads (bench/tiers_raw.py --paths compares the two)
ONE_PASS_READS = True


@dataclass(slots=True, eq=False)
class _Loc:
    segment: Segment
    offset: int  # of the record header
    crc: int


@dataclass(slots=True, eq=False)
class _Pending:
    row: torch.Tensor  # [bytes_per_block] uint8, our own copy
    crc: int | None = None  # its CRC32C where the copy took it (one pass), else taken as it is written


def _check_can_hold_files(directory: Path, name: str) -> None:
    """Create `directory` and write (then remove) a probe file in it.

    A directory that exists but cannot hold files (``/proc/self``, a read-only mount, one
    owned by another user) would otherwise be accepted here and fail at the first demotion,
    in the writer thread, long after start-up.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".sage-probe-", dir=directory)
        try:
            os.write(fd, bytes(HEADER.size))
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        why = "a file is there, not a directory" if isinstance(err, FileExistsError) else err.strerror or str(err)
        raise TierConfigError(f"{name} tier directory {directory}: cannot hold files: {why}",
                              hint="give the disk tier (tiers.disk_path) a directory this process can write") from None


class DiskTier(KVTier):
    """A bounded on-disk store of KV blocks that survives restarts."""

    persistent = True

    def __init__(
        self,
        schema: KVCacheSchema,
        directory: str | os.PathLike,
        capacity_bytes: int,
        *,
        segment_bytes: int = 64 * MiB,
        max_pending_bytes: int = 256 * MiB,
        name: str = "disk",
    ) -> None:
        super().__init__(schema, capacity_bytes, name)
        self.directory = Path(directory)
        _check_can_hold_files(self.directory, name)
        self.record_bytes = HEADER.size + self.bytes_per_block
        # at least 4 segments under the cap, so dropping one frees a quarter at most
        self.segment_bytes = max(min(segment_bytes, self.capacity_bytes // 4), self.record_bytes)
        self.max_pending_bytes = max(max_pending_bytes, self.record_bytes)
        self._segments: dict[int, Segment] = {}  # oldest first (insertion order = id order)
        self._index: dict[bytes, _Loc] = {}
        self._pending: dict[bytes, _Pending] = {}
        self._queue: deque[tuple[list[tuple[bytes, _Pending]], torch.Tensor]] = deque()  # (batch, its buffer)
        # buffers of written batches, for the next puts to copy into: fresh memory's first-touch page faults cost
        # more than the copy itself (16 MiB: 1.2 GB/s into a new buffer, 15 GB/s into a reused one, 2-vCPU VM)
        self._spare: list[torch.Tensor] = []
        self._queued_bytes = 0
        self._busy = False  # the writer holds a batch
        self._closing = False
        self._cond = threading.Condition(self._lock)
        self._append_lock = threading.Lock()  # one appender at a time: the writer thread or compact()
        self._active: Segment | None = None
        self._next_id = 0
        self._scan()
        with self._lock:
            self._evict_for(0)
        self._writer = threading.Thread(target=self._write_loop, name=f"sage-{name}-tier-writer", daemon=True)
        self._writer.start()

    # -- start-up ------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the segment headers; later records of a key win."""
        for path in segment_paths(self.directory):
            seg = Segment.open(path)
            self._segments[seg.id] = seg
            self._next_id = seg.id + 1
            for rec in seg.records():
                if rec.length < 0:  # torn: `records()` counted the rest of the file as dead
                    self._stats.skipped_records += 1
                elif rec.digest != self.digest or rec.length != self.bytes_per_block:
                    self._stats.skipped_records += 1
                    seg.dead_bytes += rec.size
                elif not rec.live:
                    seg.dead_bytes += rec.size
                else:
                    old = self._index.get(rec.key)
                    if old is not None:
                        self._kill(rec.key, old, mark=False)
                    self._index[rec.key] = _Loc(seg, rec.offset, rec.crc)
                    seg.keys.add(rec.key)

    # -- put and the writer thread -------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Copy the new blocks and queue them for the writer; returns without touching the disk. Where the one-pass
        kernel loads, the copy also takes their CRC32Cs, so the writer does not read them again."""
        keys, blocks = self._check_put(keys, blocks)
        # one pass straight from host memory; a device's blocks come over by the gather alone (no whole-batch copy)
        fused = fused_kernel() is not None and blocks.device.type == "cpu"
        self._queue_batch(keys, tensor_gather(blocks), blocks if fused else None)

    def put_gather(self, keys: Sequence[bytes], gather: Gather) -> None:
        """`put` of blocks the caller gathers straight into the writer's queue (one `gather` call per batch)."""
        self._queue_batch(self._check_keys(keys), gather)

    def _queue_batch(self, keys: list[bytes], gather: Gather, blocks: torch.Tensor | None = None) -> None:
        with self._lock:
            if self._closing:
                raise TierError(f"{self.name} tier is closed")
            self._stats.puts += len(keys)
            rows: dict[bytes, int] = {}
            for row, key in enumerate(keys):
                if key not in self._index and key not in self._pending and key not in rows:
                    rows[key] = row
            room = (self.max_pending_bytes - self._queued_bytes) // self.record_bytes
            if len(rows) > room:  # keep a chain's head: the tail is useless without it
                self._stats.dropped += len(rows) - max(room, 0)
                rows = dict(list(rows.items())[: max(room, 0)])
            if not rows:
                return
            copy = self._take_buffer(len(rows))
            crcs: list[int | None] = [None] * len(rows)
            if blocks is None:
                gather(list(rows.values()), copy)
            else:  # copied and checksummed in one pass
                crcs = copy_runs(copy, blocks, runs_of(range(len(rows)), list(rows.values())), crc_of="dst")
            batch = [(key, _Pending(copy[i], crc)) for i, (key, crc) in enumerate(zip(rows, crcs))]
            self._pending.update(batch)
            self._queue.append((batch, copy))
            self._queued_bytes += len(batch) * self.record_bytes
            self._cond.notify_all()

    def flush(self, sync: bool = False) -> None:
        """Wait until every queued block is on disk (in the page cache; `sync=True` fsyncs too)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy)
            segments = list(self._segments.values()) if sync else []
        for seg in segments:
            os.fsync(seg.fd)

    def _take_buffer(self, rows: int) -> torch.Tensor:
        """``[rows, bytes_per_block]`` uint8 to queue a batch in: a spare one's leading rows where one is large
        enough, else new. Called with the lock held."""
        for i, buf in enumerate(self._spare):
            if buf.shape[0] >= rows:
                return self._spare.pop(i)[:rows]
        return torch.empty((rows, self.bytes_per_block), dtype=torch.uint8)

    def _spare_buffer(self, buffer: torch.Tensor) -> None:
        """Keep a written batch's buffer (its rows are no longer pending: committed, or deleted and replaced) for
        the next puts, at most 4 and `max_pending_bytes` of them, the largest kept. Called with the lock held."""
        base = buffer._base if buffer._base is not None else buffer
        self._spare.append(base)
        self._spare.sort(key=lambda b: -b.shape[0])
        while len(self._spare) > 4 or sum(b.numel() for b in self._spare) > self.max_pending_bytes:
            self._spare.pop()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch, buffer = self._queue.popleft()
                self._busy = True
            try:
                records = [(key, entry.row, entry.crc, entry) for key, entry in batch]  # (None: checksummed as written)
                with self._append_lock:
                    self._recreate_if_gone()
                    self._append(records, self._commit_pending, enforce_cap=True)
            except Exception as err:  # a dead disk must not kill the writer; the blocks are lost
                with self._lock:
                    self._stats.errors += len(batch)
                    self._background_errors.append(f"{self.name} tier: writing {len(batch)} blocks to "
                                                   f"{self.directory} failed: {err}")
                    for key, entry in batch:
                        if self._pending.get(key) is entry:
                            del self._pending[key]
            finally:
                with self._cond:
                    self._queued_bytes -= len(batch) * self.record_bytes
                    self._spare_buffer(buffer)
                    self._busy = False
                    self._cond.notify_all()

    def _recreate_if_gone(self) -> None:
        """The directory was deleted under us (its segments with it, though our open files still take writes that
        no restart would find): forget every segment, make the directory again and say so. Called by an appender."""
        if self.directory.is_dir():
            return
        with self._lock:
            lost = len(self._index)
            for seg in list(self._segments.values()):
                self._drop_segment(seg)
            self._index.clear()
            self._active = None
            self.directory.mkdir(parents=True, exist_ok=True)
            self._background_errors.append(f"{self.name} tier: {self.directory} disappeared; made it again, and the "
                                           f"{lost} blocks stored there are gone")

    def _commit_pending(self, key: bytes, token: object) -> bool:
        if self._pending.get(key) is not token:
            return False  # deleted while queued
        del self._pending[key]
        return True

    def _append(
        self,
        records: list[tuple[bytes, torch.Tensor, int, object]],
        commit: Callable[[bytes, object], bool],
        enforce_cap: bool,
    ) -> None:
        """Write (key, payload, crc, token) records at the end; index each one `commit` accepts.

        Called with `_append_lock` held. Layout decisions (segment roll, eviction) are made
        under the tier lock; the pwritev itself is not, so reads go on during writes.
        """
        i = 0
        while i < len(records):
            with self._lock:
                seg = self._active
                if seg is None or seg.size + self.record_bytes > self.segment_bytes:
                    seg = self._roll()
                take = min(len(records) - i, (self.segment_bytes - seg.size) // self.record_bytes, _IOV_MAX // 2)
                if enforce_cap:
                    self._evict_for(take * self.record_bytes)
                start = seg.size
                seg.size += take * self.record_bytes  # reserve: a concurrent read never sees a half record
            chunk = records[i : i + take]
            crcs = self._write_records(seg, start, chunk)
            with self._lock:
                for j, ((key, _, _, token), crc) in enumerate(zip(chunk, crcs)):
                    offset = start + j * self.record_bytes
                    if commit(key, token):
                        old = self._index.get(key)
                        if old is not None:
                            self._kill(key, old, mark=False)
                        self._index[key] = _Loc(seg, offset, crc)
                        seg.keys.add(key)
                    else:
                        seg.dead_bytes += self.record_bytes
                        seg.mark_dead(offset)
            i += take

    def _write_records(self, seg: Segment, start: int, records: list[tuple[bytes, torch.Tensor, int | None, object]]
                       ) -> list[int]:
        """pwritev `records` at `start` of `seg` in pieces of up to `WRITE_PIECE` bytes, each checksummed (where its
        CRC is None) just before it is written; a large batch's pieces go out in parallel (queue depth > 1).
        Returns each record's CRC32C."""
        per = max(1, WRITE_PIECE // self.record_bytes)

        def write(first: int) -> list[int]:
            part = records[first : first + per]
            # (releasing the GIL: this is the writer thread, beside the engine's)
            crcs = [crc32c.crc32c(payload.numpy(), gil_release_mode=1) if crc is None else crc
                    for _, payload, crc, _ in part]
            buffers: list = []
            for (key, payload, _, _), crc in zip(part, crcs):
                buffers += (encode_header(self.digest, key, self.bytes_per_block, crc), payload.numpy())
            written = os.pwritev(seg.fd, buffers, start + first * self.record_bytes)
            if written != len(part) * self.record_bytes:
                raise TierError(f"{self.name} tier: short write to {seg.path} ({written} bytes)")
            return crcs

        firsts = range(0, len(records), per)
        if parallel(self.bytes_per_block, len(records) * self.bytes_per_block):
            done = list(move_pool().map(write, firsts))
        else:
            done = [write(first) for first in firsts]
        return [crc for part in done for crc in part]

    def _roll(self) -> Segment:
        seg = Segment.create(self.directory, self._next_id)
        self._next_id += 1
        self._segments[seg.id] = seg
        self._active = seg
        return seg

    def _evict_for(self, incoming: int) -> None:
        """Drop the oldest segments until `incoming` more bytes fit under the cap (never the active one)."""
        total = sum(seg.size for seg in self._segments.values())
        for seg in list(self._segments.values()):
            if total + incoming <= self.capacity_bytes:
                return
            if seg is self._active:
                continue
            total -= seg.size
            self._stats.evictions += len(seg.keys)
            self._drop_segment(seg)

    def _drop_segment(self, seg: Segment) -> None:
        for key in seg.keys:
            del self._index[key]
        seg.keys.clear()
        del self._segments[seg.id]
        seg.doomed = True
        seg.path.unlink(missing_ok=True)
        if seg.readers == 0:
            seg.close()

    def _kill(self, key: bytes, loc: _Loc, mark: bool) -> None:
        """Forget `key`'s record in `loc` (under the lock); `mark` rewrites its magic on disk."""
        if self._index.get(key) is loc:
            del self._index[key]
        loc.segment.keys.discard(key)
        loc.segment.dead_bytes += self.record_bytes
        if mark and not loc.segment.doomed:
            loc.segment.mark_dead(loc.offset)

    # -- reads ---------------------------------------------------------------------------------

    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]:
        found = [False] * len(keys)
        reads: list[tuple[int, bytes, _Loc]] = []
        with self._lock:
            for row, key in enumerate(keys):
                entry = self._pending.get(key)
                if entry is not None:  # still queued: our own copy, in memory
                    out[row].copy_(entry.row)
                    found[row] = True
                    continue
                loc = self._index.get(key)
                if loc is None:
                    if prefix:
                        break
                    continue
                loc.segment.readers += 1  # keeps the fd open if the segment is dropped meanwhile
                reads.append((row, key, loc))
        bad: list[tuple[bytes, _Loc, bool]] = []  # (key, loc, is_io_error)
        stop = len(keys)
        for row, key, loc, ok, io_error in self._read_records(reads, out):
            found[row] = ok
            if not ok:
                bad.append((key, loc, io_error))
                if prefix:
                    stop = min(stop, row)
        with self._lock:
            for _, _, loc in reads:
                seg = loc.segment
                seg.readers -= 1
                if seg.doomed and seg.readers == 0:
                    seg.close()
            for key, loc, io_error in bad:
                if io_error:
                    self._stats.errors += 1
                else:
                    self._stats.checksum_failures += 1
                if self._index.get(key) is loc:
                    self._kill(key, loc, mark=True)
        if prefix:
            found[stop:] = [False] * (len(keys) - stop)
        return found

    def _read_records(self, reads: list[tuple[int, bytes, _Loc]], out: torch.Tensor
                      ) -> list[tuple[int, bytes, _Loc, bool, bool]]:
        """Read (row, key, loc) payloads into ``out[row]`` and verify them: (row, key, loc, ok, io_error) each.

        Records next to each other in one segment, for consecutive rows, are read with one preadv (the headers
        between the payloads land in a scratch buffer), ~1 MiB at a time and checksummed right after, while in
        cache; a large read's pieces run in parallel (queue depth > 1)."""
        out_np = out.numpy()
        kernel = fused_kernel() if out.stride(1) == 1 and ONE_PASS_READS else None
        # (a mapped group has no cache to stay in: larger groups, fewer mappings)
        per = max(1, (MAP_GROUP if kernel is not None else CACHE_CHUNK) // self.record_bytes)
        groups: list[list[tuple[int, bytes, _Loc]]] = []
        for read in reads:
            last = groups[-1][-1] if groups else None
            if (last is not None and len(groups[-1]) < per and read[0] == last[0] + 1
                    and read[2].segment is last[2].segment and read[2].offset == last[2].offset + self.record_bytes):
                groups[-1].append(read)
            else:
                groups.append([read])

        # a large read streams its stores (into rows not in cache) even where each group is under the kernel's
        # own threshold
        stream = 1 if kernel is not None and len(reads) * self.bytes_per_block >= kernel.copy_stream_min_bytes() else 0

        def read_group(group: list[tuple[int, bytes, _Loc]]) -> list[tuple[int, bytes, _Loc, bool, bool]]:
            if kernel is not None:
                return self._read_group_fused(kernel, group, out, stream)
            first, n = group[0][0], len(group)
            scratch = bytearray(HEADER.size)
            buffers: list = []
            for j in range(n):
                buffers += ([scratch] if j else []) + [out_np[first + j]]
            try:
                got = os.preadv(group[0][2].segment.fd, buffers, group[0][2].offset + HEADER.size)
            except OSError:
                return [(row, key, loc, False, True) for row, key, loc in group]
            whole = (got + HEADER.size) // self.record_bytes  # records read to their end (a short read stops early)
            crcs = crc_rows(out_np[first : first + min(whole, n)], release_gil=True)  # (a loader thread, mostly)
            return [(row, key, loc, j < whole and crcs[j] == loc.crc, False) for j, (row, key, loc) in enumerate(group)]

        if parallel(self.bytes_per_block, len(reads) * self.bytes_per_block) and len(groups) > 1:
            done = list(move_pool().map(read_group, groups))
        else:
            done = [read_group(group) for group in groups]
        return [result for part in done for result in part]

    def _read_group_fused(self, kernel: ModuleType, group: list[tuple[int, bytes, _Loc]], out: torch.Tensor,
                          stream: int) -> list[tuple[int, bytes, _Loc, bool, bool]]:
        """`_read_records` of one group in one pass: the records' span of the segment is mapped (the page cache's
        own pages, no copy) and the kernel copies each payload into ``out``'s rows and checksums it in the same
        pass (`copy_rows_crc32c`). Only what the file holds is mapped: a record past its end reads as short."""
        first, n, loc0 = group[0][0], len(group), group[0][2]
        bpb, record = self.bytes_per_block, self.record_bytes
        start = loc0.offset + HEADER.size  # the first payload; payload j starts j records later
        try:
            size = os.fstat(loc0.segment.fd).st_size
            whole = max(0, min(n, (size - start + HEADER.size) // record))  # records the file holds to their end
            if whole == 0:
                return [(row, key, loc, False, False) for row, key, loc in group]
            base = start - start % mmap.ALLOCATIONGRANULARITY
            span = start - base + (whole - 1) * record + bpb
            mapped = mmap.mmap(loc0.segment.fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                               offset=base)
        except OSError:
            return [(row, key, loc, False, True) for row, key, loc in group]
        try:
            with warnings.catch_warnings():  # (torch warns that the read-only mapping is shared; it is only read)
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))
            rows = flat.as_strided((whole, bpb), (record, 1), start - base)
            crcs = kernel.copy_rows_crc32c(out[first : first + whole], rows, torch.tensor([[0, 0, whole]]),
                                           stream).tolist()
            del flat, rows
        finally:
            mapped.close()
        return [(row, key, loc, j < whole and crcs[j] == loc.crc, False) for j, (row, key, loc) in enumerate(group)]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = self._check_keys(keys)
        with self._lock:
            return [key in self._pending or key in self._index for key in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = self._check_keys(keys)
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)  # the writer marks its record dead when it gets there
                loc = self._index.get(key)
                if loc is not None:
                    self._kill(key, loc, mark=True)

    # -- space ---------------------------------------------------------------------------------

    def compact(self, min_fragmentation: float = 0.5, max_segments: int | None = None) -> int:
        """Rewrite the live records of segments at least `min_fragmentation` dead (most dead first).

        The live records go to the end of the newest segment and the old files are removed.
        The cap may be passed by at most one segment's live bytes while this runs. Returns the
        number of bytes of segment files reclaimed.
        """
        self.flush()
        reclaimed = 0
        with self._append_lock:
            with self._lock:
                active = self._active
                if active is not None and active.size and active.dead_bytes / active.size >= min_fragmentation:
                    self._active = None  # seal it: the live records move to a new segment
                victims = sorted(
                    (s for s in self._segments.values() if s is not self._active and s.size),
                    key=lambda s: s.dead_bytes / s.size,
                    reverse=True,
                )
                victims = [s for s in victims if s.dead_bytes / s.size >= min_fragmentation][:max_segments]
            for seg in victims:
                with self._lock:
                    if seg.doomed:
                        continue
                    live = [(key, self._index[key]) for key in seg.keys]
                keys = [key for key, _ in live]
                rows = torch.empty((len(keys), self.bytes_per_block), dtype=torch.uint8)
                found = self._load(keys, rows, prefix=False) if keys else []
                records = [(key, rows[i], loc.crc, loc) for i, (key, loc) in enumerate(live) if found[i]]
                self._append(records, lambda key, loc: self._index.get(key) is loc, enforce_cap=False)
                with self._lock:
                    if not seg.doomed:
                        reclaimed += seg.size
                        self._stats.evictions += len(seg.keys)  # deleted while being copied: gone anyway
                        self._drop_segment(seg)
                        reclaimed -= len(records) * self.record_bytes
        return reclaimed

    def _refresh_stats(self) -> None:
        total = sum(seg.size for seg in self._segments.values())
        dead = sum(seg.dead_bytes for seg in self._segments.values())
        self._stats.blocks = len(self._index) + len(self._pending)
        self._stats.bytes = total
        self._stats.pending_blocks = len(self._pending)
        self._stats.fragmentation = dead / total if total else 0.0

    def close(self) -> None:
        """Write what is queued, stop the writer and close the files (they stay for the next start)."""
        with self._cond:
            if self._closing:
                return
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join()
        with self._lock:
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._index.clear()
