"""`DiskTier`: KV blocks in append-only segment files under one directory, with a size cap.

- Writes go through one background writer thread: `put` copies the rows into a batch buffer laid out as the
  records will sit on disk (header, payload, header, payload, ...) and queues it (bounded by `max_pending_bytes`;
  a full queue drops the batch's tail and counts it), so the engine never waits for the disk. Where the one-pass
  kernel loads, the copy also takes each payload's CRC32C (a gather from the KV pool too: `rows.ChunkGather`).
  The writer fills the batch's headers at once (numpy) and writes the batch with one `pwritev` per segment it
  lands in. Queued blocks are readable at once.
- An in-memory index ``key -> (segment, offset, crc)`` is rebuilt at start-up by
  reading every record header (format in `segment.py`); records of another schema, and a
  torn record at a segment's end, are skipped and counted in `skipped_records`.
- Reads go from a kept-open fd, a batch planned as arrays (`disk_read.py`): where the one-pass copy + CRC kernel
  loads, a run of records is mapped (mmap of the page cache's pages) and copied into the caller's rows and
  checksummed in one pass, each byte read once; elsewhere `os.preadv` straight into the caller's rows, then CRC32C.
- Eviction is FIFO by write time, a segment at a time: when the next record would pass the
  cap, the oldest segment's file is removed (its blocks count as evictions).
- Deletes mark records dead (on disk too, by the writer thread); `compact()` rewrites the live records of the
  most fragmented segments at the end and removes them. Compacted blocks count as newly written.
- `flush(sync=True)` fdatasyncs the segments written (or marked) since the last one, and the directory when a
  segment was created or removed since.
"""

from __future__ import annotations

import operator
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers.base import KVTier
from sage_infer.kv_runtime.tiers.disk_read import read_batch
from sage_infer.kv_runtime.tiers.rows import (
    ChunkGather,
    Gather,
    crc_rows,
    fused_kernel,
    move_pool,
    parallel,
    runs_of,
    tensor_gather,
)
from sage_infer.kv_runtime.tiers.segment import HEADER, Segment, encode_headers, segment_paths
from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError, TierError

MiB = 1 << 20
# a large batch's write is cut into pieces this large where there are row threads to write them side by side
WRITE_PIECE = 4 * MiB
# False: reads take the two-pass path (preadv into the caller's rows, then their CRC32C) even where the one-pass
# kernel loads (bench/tiers_raw.py --paths compares the two)
ONE_PASS_READS = True
_fdatasync = getattr(os, "fdatasync", os.fsync)  # (macOS has no fdatasync)


class _Loc(NamedTuple):
    """Where a key's live record is; compared by identity (a read or a compaction checks that the index still
    holds the very record it worked on)."""

    segment: Segment
    offset: int  # of the record header
    crc: int


_new_loc = tuple.__new__  # (_Loc, (segment, offset, crc)) without the namedtuple's Python-level __new__


class _Batch:
    """One `put`'s blocks, queued for the writer: ``records: [n, HEADER.size + bytes_per_block]`` uint8, row i
    the i-th record as it will sit on disk (its header filled by the writer), `payloads` the rows' payload
    columns. `crcs`: the payloads' CRC32Cs where the copy took them, else None (the writer takes them).
    `entries[i]` is ``(self, i)``, the value the tier's pending map holds for ``keys[i]`` while it is queued."""

    __slots__ = ("keys", "records", "payloads", "crcs", "entries")

    def __init__(self, keys: list[bytes], records: torch.Tensor, crcs: np.ndarray | None) -> None:
        self.keys, self.records, self.crcs = keys, records, crcs
        self.payloads = records[:, HEADER.size :]
        self.entries = list(zip(repeat(self), range(len(keys))))


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
        self._pending: dict[bytes, tuple[_Batch, int]] = {}  # queued blocks: their batch and row
        self._queue: deque[_Batch] = deque()
        self._marks: list[tuple[Segment, int]] = []  # deleted records whose magic the writer rewrites
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
        self._unsynced: set[Segment] = set()  # written or marked since the last flush(sync=True)
        self._directory_changed = False  # a segment created or removed since then
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
        kernel = fused_kernel()
        if kernel is not None and blocks.device.type == "cpu":  # one pass straight from host memory

            def fill(rows: list[int], payloads: torch.Tensor) -> np.ndarray | None:
                runs = torch.tensor(runs_of(range(len(rows)), rows), dtype=torch.long).reshape(-1, 3)
                return kernel.copy_rows_crc32c(payloads, blocks, runs).numpy().astype(np.uint32)

            self._queue_batch(keys, fill)
        else:  # (a device's blocks come over by the gather alone: no whole-batch copy)
            self.put_gather(keys, tensor_gather(blocks))

    def put_gather(self, keys: Sequence[bytes], gather: Gather) -> None:
        """`put` of blocks the caller gathers straight into the writer's queue (one `gather` call per batch; a
        `ChunkGather` checksums as it gathers where the one-pass kernel loads)."""

        def fill(rows: list[int], payloads: torch.Tensor) -> np.ndarray | None:
            if isinstance(gather, ChunkGather):
                # (one thread: a second one's OpenMP spin after the copy took the core the writer thread needs
                # next, `bench/tiers_raw.py` "disk demote" 0.41-0.43 of a pwritev on one, 0.25-0.45 on two)
                crcs = gather.gather_crc(rows, payloads, threads=1)
                if crcs is not None:
                    return crcs
            staged = torch.empty((len(rows), self.bytes_per_block), dtype=torch.uint8)  # (a gather's out is whole)
            gather(rows, staged)
            kernel = fused_kernel()
            if kernel is not None:
                return kernel.copy_rows_crc32c(payloads, staged, torch.tensor([[0, 0, len(rows)]])).numpy().astype(
                    np.uint32)
            payloads.numpy()[:] = staged.numpy()
            return None

        self._queue_batch(self._check_keys(keys), fill)

    def _queue_batch(self, keys: list[bytes], fill: Callable[[list[int], torch.Tensor], np.ndarray | None]) -> None:
        """Queue the batch's new keys; `fill(rows, payloads)` copies batch rows `rows` into `payloads` and returns
        their CRC32Cs where it took them."""
        with self._lock:
            if self._closing:
                raise TierError(f"{self.name} tier is closed")
            self._stats.puts += len(keys)
            new_keys, rows = self._new_rows(keys)
            room = max(0, (self.max_pending_bytes - self._queued_bytes) // self.record_bytes)
            if len(rows) > room:  # keep a chain's head: the tail is useless without it
                self._stats.dropped += len(rows) - room
                new_keys, rows = new_keys[:room], rows[:room]
            if not rows:
                return
            records = self._take_buffer(len(rows))
            batch = _Batch(new_keys, records, None)
            batch.crcs = fill(rows, batch.payloads)
            self._pending.update(zip(new_keys, batch.entries))
            self._queue.append(batch)
            self._queued_bytes += len(rows) * self.record_bytes
            self._cond.notify_all()

    def _new_rows(self, keys: list[bytes]) -> tuple[list[bytes], list[int]]:
        """The batch's keys neither stored nor queued (first occurrence) and their rows. Called with the lock held."""
        index, pending = self._index, self._pending
        if not any(map(index.__contains__, keys)) and not any(map(pending.__contains__, keys)) and (
                len(set(keys)) == len(keys)):  # (the usual batch, checked in C)
            return keys, list(range(len(keys)))
        rows: dict[bytes, int] = {}
        for row, key in enumerate(keys):
            if key not in index and key not in pending and key not in rows:
                rows[key] = row
        return list(rows), list(rows.values())

    def flush(self, sync: bool = False) -> None:
        """Wait until every queued block is on disk (in the page cache); `sync=True`: durably, with one fdatasync
        per segment written since the last such flush (and one of the directory where it gained or lost files)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._marks and not self._busy)
            if not sync:
                return
            segments, self._unsynced = self._unsynced, set()
            directory, self._directory_changed = self._directory_changed, False
            for seg in segments:
                seg.readers += 1  # keeps the fd open if the segment is dropped meanwhile
        try:
            for seg in segments:
                if not seg.doomed:
                    _fdatasync(seg.fd)
            if directory:
                fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            with self._lock:
                for seg in segments:
                    self._release(seg)

    def _take_buffer(self, rows: int) -> torch.Tensor:
        """``[rows, record_bytes]`` uint8 to queue a batch in: a spare one's leading rows where one is large
        enough, else new. Called with the lock held."""
        for i, buf in enumerate(self._spare):
            if buf.shape[0] >= rows:
                return self._spare.pop(i)[:rows]
        return torch.empty((rows, self.record_bytes), dtype=torch.uint8)

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
                self._cond.wait_for(lambda: self._queue or self._marks or self._closing)
                if self._marks:
                    marks, self._marks = self._marks, []
                    segments = {seg for seg, _ in marks}
                    for seg in segments:
                        seg.readers += 1  # keeps the fd open if the segment is dropped meanwhile
                    self._busy = True
                elif not self._queue:
                    return
                else:
                    marks = []
                    batch = self._queue.popleft()
                    self._busy = True
            if marks:
                self._write_marks(marks, segments)
                continue
            try:
                if batch.crcs is None:  # (releasing the GIL: this is the writer thread, beside the engine's)
                    batch.crcs = np.array(crc_rows(batch.payloads.numpy(), release_gil=True), dtype=np.uint32)
                encode_headers(batch.records, self.digest, batch.keys, self.bytes_per_block, batch.crcs)
                with self._append_lock:
                    self._recreate_if_gone()
                    self._append(batch.keys, batch.records, batch.crcs.tolist(), batch.entries, self._commit_pending,
                                 enforce_cap=True)
            except Exception as err:  # a dead disk must not kill the writer; the blocks are lost
                with self._lock:
                    self._stats.errors += len(batch.keys)
                    self._background_errors.append(f"{self.name} tier: writing {len(batch.keys)} blocks to "
                                                   f"{self.directory} failed: {err}")
                    self._commit_pending(batch.keys, batch.entries)  # (forgets them)
            finally:
                with self._cond:
                    self._queued_bytes -= len(batch.keys) * self.record_bytes
                    self._spare_buffer(batch.records)
                    batch.entries = []  # (none is pending now; and no cycle keeps the batch's buffer alive)
                    self._busy = False
                    self._cond.notify_all()

    def _write_marks(self, marks: list[tuple[Segment, int]], segments: set[Segment]) -> None:
        """Rewrite the magic of deleted records (`Segment.mark_dead`), in file order, off the caller's thread: a
        delete of a loaded chain costs its caller no write per block. A crash before a mark only brings back a
        block whose bytes are still right for its key."""
        try:
            for seg, offset in sorted(marks, key=lambda mark: (mark[0].id, mark[1])):
                if not seg.doomed:
                    seg.mark_dead(offset)
        except OSError as err:
            self._background_errors.append(f"{self.name} tier: marking deleted blocks in {self.directory} failed: "
                                           f"{err}")
        finally:
            with self._cond:
                for seg in segments:
                    self._release(seg)
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

    def _commit_pending(self, keys: list[bytes], entries: list[tuple[_Batch, int]]) -> list[bool]:
        """Which of a written batch's keys are still queued as its own (the others were deleted, or deleted and
        queued again, meanwhile); those leave the pending map. Called with the lock held."""
        pending = self._pending
        mine = list(map(operator.is_, map(pending.get, keys), entries))
        for key, ours in zip(keys, mine):
            if ours:
                del pending[key]
        return mine

    def _append(
        self,
        keys: list[bytes],
        records: torch.Tensor,
        crcs: list[int],
        tokens: list,
        owned: Callable[[list[bytes], list], list[bool]],
        enforce_cap: bool,
    ) -> None:
        """Write ``records: [n, record_bytes]`` (headers filled) at the end, one pwrite per segment they land in;
        index each key that `owned(keys, tokens)` (asked under the lock, after the write) still claims.

        Called with `_append_lock` held. Layout decisions (segment roll, eviction) are made
        under the tier lock; the pwrite itself is not, so reads go on during writes.
        """
        flat = records.numpy()
        i = 0
        while i < len(keys):
            with self._lock:
                seg = self._active
                if seg is None or seg.size + self.record_bytes > self.segment_bytes:
                    seg = self._roll()
                take = min(len(keys) - i, (self.segment_bytes - seg.size) // self.record_bytes)
                if enforce_cap:
                    self._evict_for(take * self.record_bytes)
                start = seg.size
                seg.size += take * self.record_bytes  # reserve: a concurrent read never sees a half record
                self._unsynced.add(seg)
            self._write_at(seg, start, flat[i : i + take])
            with self._lock:
                self._index_written(seg, start, keys[i : i + take], crcs[i : i + take],
                                    owned(keys[i : i + take], tokens[i : i + take]))
            i += take

    def _write_at(self, seg: Segment, start: int, records: np.ndarray) -> None:
        """Write contiguous `records` at `start` of `seg`: one call (a large one in pieces side by side where there
        are row threads: queue depth > 1)."""
        data = memoryview(records.reshape(-1))

        def write(first: int, end: int) -> None:
            while first < end:  # (a short write continues; a full disk or a file size limit raises)
                written = os.pwritev(seg.fd, [data[first:end]], start + first)
                if written <= 0:
                    raise TierError(f"{self.name} tier: short write to {seg.path} ({first} bytes)")
                first += written

        total = len(data)
        if parallel(self.bytes_per_block, total):
            piece = max(self.record_bytes, WRITE_PIECE // self.record_bytes * self.record_bytes)
            list(move_pool().map(lambda first: write(first, min(total, first + piece)), range(0, total, piece)))
        else:
            write(0, total)

    def _index_written(self, seg: Segment, start: int, keys: list[bytes], crcs: list[int], owned: list[bool]
                       ) -> None:
        """Index the records just written at `start` of `seg` whose keys are `owned`; the others are dead bytes
        (marked on disk). Called with the lock held."""
        offsets = range(start, start + len(keys) * self.record_bytes, self.record_bytes)
        index = self._index
        if all(owned) and not any(map(index.__contains__, keys)):  # (the usual batch: no Python per record)
            index.update(zip(keys, map(_new_loc, repeat(_Loc), zip(repeat(seg), offsets, crcs))))
            seg.keys.update(keys)
            return
        for key, offset, crc, ours in zip(keys, offsets, crcs, owned):
            if ours:
                old = index.get(key)
                if old is not None:
                    self._kill(key, old, mark=False)
                index[key] = _Loc(seg, offset, crc)
                seg.keys.add(key)
            else:
                seg.dead_bytes += self.record_bytes
                seg.mark_dead(offset)

    def _roll(self) -> Segment:
        seg = Segment.create(self.directory, self._next_id)
        self._next_id += 1
        self._segments[seg.id] = seg
        self._active = seg
        self._directory_changed = True
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
        self._unsynced.discard(seg)
        self._directory_changed = True
        if seg.readers == 0:
            seg.close()

    def _release(self, seg: Segment) -> None:
        """A read (or sync) of `seg` is done: close a dropped segment's fd after its last one. Under the lock."""
        seg.readers -= 1
        if seg.doomed and seg.readers == 0:
            seg.close()

    def _kill(self, key: bytes, loc: _Loc, mark: bool) -> None:
        """Forget `key`'s record in `loc` (under the lock); `mark` rewrites its magic on disk."""
        if self._index.get(key) is loc:
            del self._index[key]
        loc.segment.keys.discard(key)
        loc.segment.dead_bytes += self.record_bytes
        if mark and not loc.segment.doomed:  # (by the writer thread, `_write_marks`)
            self._marks.append((loc.segment, loc.offset))
            self._unsynced.add(loc.segment)
            self._cond.notify_all()

    # -- reads ---------------------------------------------------------------------------------

    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]:
        n = len(keys)
        found = np.zeros(n, dtype=bool)
        with self._lock:
            locs = list(map(self._index.get, keys))
            if self._pending:  # still queued: our own copy, in memory (read under the lock: the buffer is reused
                # once written)
                queued = list(map(self._pending.get, keys))
                stop = next((row for row in range(n) if queued[row] is None and locs[row] is None), n) if prefix else n
                self._copy_queued(queued[:stop], out, found)
                reads = [row for row in range(stop) if queued[row] is None and locs[row] is not None]
                locs = [locs[row] for row in reads]
            else:
                stop = locs.index(None) if prefix and None in locs else n
                if stop == n and None not in locs:
                    reads = list(range(n))
                else:
                    reads = [row for row in range(stop) if locs[row] is not None]
                    locs = [locs[row] for row in reads]
            segments = set(map(operator.itemgetter(0), locs))
            for seg in segments:
                seg.readers += 1  # keeps the fd open if the segment is dropped meanwhile
        rows = np.asarray(reads, dtype=np.int64)
        try:
            kernel = fused_kernel() if out.stride(1) == 1 and ONE_PASS_READS else None
            ok, io_error = read_batch(locs, rows, out, kernel, self.bytes_per_block)
        finally:
            with self._lock:
                for seg in segments:
                    self._release(seg)
        found[rows[ok]] = True
        bad = np.flatnonzero(~ok)
        if len(bad):
            self._forget_bad([keys[reads[j]] for j in bad], [locs[j] for j in bad], io_error[bad].tolist())
        if prefix and not found[:stop].all():
            stop = int(np.argmin(found[:stop]))
        found[stop:] = False
        return found.tolist()

    def _copy_queued(self, queued: list[tuple[_Batch, int] | None], out: torch.Tensor, found: np.ndarray) -> None:
        """``out[row]`` = each queued block's row of its batch buffer, batch by batch. Called with the lock held."""
        by_batch: dict[_Batch, tuple[list[int], list[int]]] = {}
        for row, entry in enumerate(queued):
            if entry is not None:
                rows, sources = by_batch.setdefault(entry[0], ([], []))
                rows.append(row)
                sources.append(entry[1])
        out_np = out.numpy()
        for batch, (rows, sources) in by_batch.items():
            out_np[rows] = batch.payloads.numpy()[sources]
            found[rows] = True

    def _forget_bad(self, keys: list[bytes], locs: list[_Loc], io_errors: list[bool]) -> None:
        """Count and drop records that read back corrupt (or could not be read)."""
        with self._lock:
            for key, loc, io_error in zip(keys, locs, io_errors):
                if io_error:
                    self._stats.errors += 1
                else:
                    self._stats.checksum_failures += 1
                if self._index.get(key) is loc:
                    self._kill(key, loc, mark=True)

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
                moved = self._move_live(live)
                with self._lock:
                    if not seg.doomed:
                        reclaimed += seg.size
                        self._stats.evictions += len(seg.keys)  # deleted while being copied: gone anyway
                        self._drop_segment(seg)
                        reclaimed -= moved * self.record_bytes
        return reclaimed

    def _move_live(self, live: list[tuple[bytes, _Loc]]) -> int:
        """Append the records `live` (key, where it is) again at the end; those still live when written are indexed
        there. Returns how many were read back whole. Called with `_append_lock` held."""
        if not live:
            return 0
        keys = [key for key, _ in live]
        records = torch.empty((len(keys), self.record_bytes), dtype=torch.uint8)
        found = np.array(self._load(keys, records[:, HEADER.size :], prefix=False), dtype=bool)
        kept = np.flatnonzero(found).tolist()
        if len(kept) != len(keys):
            records = records[torch.from_numpy(found)]
            live = [live[i] for i in kept]
            keys = [key for key, _ in live]
        crcs = [loc.crc for _, loc in live]
        encode_headers(records, self.digest, keys, self.bytes_per_block, np.array(crcs, dtype=np.uint32))
        self._append(keys, records, crcs, [loc for _, loc in live],
                     lambda keys, locs: list(map(operator.is_, map(self._index.get, keys), locs)), enforce_cap=False)
        return len(keys)

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
