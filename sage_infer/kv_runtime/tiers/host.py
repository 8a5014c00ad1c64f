"""`HostTier`: KV blocks in host DRAM, in one preallocated slab.

Layout: ``slab: [num_slots, bytes_per_block]`` uint8, carved once from a `SharedArena`
(memfd-backed), so the transport can later send a block straight from its slot without a
copy, and pinned in place when CUDA is present (`pinned.pin_host_memory`). A free-slot
stack, ``key -> slot`` and one CRC32C per slot are all the bookkeeping: no allocation
after start-up.

Eviction is LRU by last access (put or hit). Within one batch, later keys count as older,
so a chain of blocks loses its tail before its head (the head is what every load needs).

Checksums of a large `put` (4 MiB or more) are taken off the caller's thread: the put is one
memcpy per run of slots, and a checksum thread takes each new slot's CRC32C from the slab
right after (`drain` waits for it); a small put checksums each ~1 MiB run as it copies it,
while it is in cache, which is faster than handing it over. A read of a slot whose checksum
is still pending takes it while copying (the block was written moments ago, by this
process); every other read verifies. The window in which a corrupted slab row would go
unnoticed is the checksum thread's lag, not the block's life. With `background_crc=False`
every put checksums as it copies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import crc32c
import numpy as np
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers.base import KVTier
from sage_infer.kv_runtime.tiers.pinned import pin_host_memory
from sage_infer.transport.arena import SharedArena

CACHE_CHUNK = 1 << 20  # copy this much, then checksum it while it is still in cache
# below this much per put, copy + checksum in cache beats handing the checksums to the thread; above it the
# thread wins (`bench/tiers_raw.py`: "put, crc inline" against "put, crc on thread")
BACKGROUND_CRC_MIN_BYTES = 4 << 20


def copy_and_crc(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int]) -> list[int]:
    """``dst[dst_rows[i]] = src[src_rows[i]]``; returns the CRC32C of each copied ``dst`` row.

    Rows are copied in runs (consecutive on both sides, so a fresh slab's batch is a few
    memcpys) of at most ~1 MiB, each checksummed right after its copy while it is still in
    cache, which measured faster than one big copy followed by the CRCs (`bench/tiers_raw.py`).
    """
    chunk = max(1, CACHE_CHUNK // max(1, dst.shape[1]))
    dst_np = dst.numpy()
    crcs: list[int] = []
    i, n = 0, len(dst_rows)
    while i < n:
        j = i + 1
        while j < n and j - i < chunk and dst_rows[j] == dst_rows[j - 1] + 1 and src_rows[j] == src_rows[j - 1] + 1:
            j += 1
        d, s = dst_rows[i], src_rows[i]
        dst[d : d + j - i].copy_(src[s : s + j - i])
        crcs.extend(crc32c.crc32c(dst_np[row]) for row in range(d, d + j - i))
        i = j
    return crcs


def copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int]) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]``, one copy per run of consecutive rows on both sides."""
    i, n = 0, len(dst_rows)
    while i < n:
        j = i + 1
        while j < n and dst_rows[j] == dst_rows[j - 1] + 1 and src_rows[j] == src_rows[j - 1] + 1:
            j += 1
        d, s = dst_rows[i], src_rows[i]
        dst[d : d + j - i].copy_(src[s : s + j - i])
        i = j


class HostTier(KVTier):
    """A bounded DRAM store of ``capacity_bytes // bytes_per_block`` KV blocks."""

    def __init__(self, schema: KVCacheSchema, capacity_bytes: int, *, name: str = "host", pin: bool = True,
                 background_crc: bool = True, background_min_bytes: int = BACKGROUND_CRC_MIN_BYTES) -> None:
        super().__init__(schema, capacity_bytes, name)
        self.num_slots = self.capacity_bytes // self.bytes_per_block
        self.arena = SharedArena(self.num_slots * self.bytes_per_block)
        self.slab = self.arena.tensor((self.num_slots, self.bytes_per_block), torch.uint8)
        self.pinned = pin_host_memory(self.slab) if pin else False
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0, 1, 2, ...
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._crc = np.zeros(self.num_slots, dtype=np.uint32)
        self._gen = np.zeros(self.num_slots, dtype=np.int64)  # bumped on every write of a slot
        self._pending: dict[int, int] = {}  # slot -> generation whose checksum is not taken yet
        self._work = threading.Condition(self._lock)
        self._closed = False
        self._checksummer = None
        self.background_min_bytes = background_min_bytes  # smaller puts checksum inline
        if background_crc:
            self._checksummer = threading.Thread(target=self._checksum_loop, name=f"sage-{name}-crc", daemon=True)
            self._checksummer.start()

    def keys(self) -> list[bytes]:
        """Every stored key, least recently used first."""
        with self._lock:
            return list(self._slot_of)

    def slot_of(self, key: bytes) -> int | None:
        """The slab row holding `key` (for sending from the slab, and tests); valid until the next put/delete."""
        with self._lock:
            return self._slot_of.get(key)

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Copy each new block into a slot (evicting LRU blocks when none is free); known keys are only touched."""
        keys, blocks = self._check_put(keys, blocks)
        with self._lock:
            self._stats.puts += len(keys)
            new: dict[bytes, int] = {}  # key -> row of `blocks`, first occurrence
            for row, key in enumerate(keys):
                if key in self._slot_of:
                    self._slot_of.move_to_end(key)  # protect it from this batch's evictions
                elif key not in new:
                    new[key] = row
            if len(new) > self.num_slots:  # keep a chain's head: the tail is useless without it
                self._stats.dropped += len(new) - self.num_slots
                new = dict(list(new.items())[: self.num_slots])
            slots = [self._take_slot() for _ in new]
            if self._checksummer is None or len(slots) * self.bytes_per_block < self.background_min_bytes:
                self._crc[slots] = copy_and_crc(self.slab, slots, blocks.cpu(), list(new.values()))
            else:
                copy_rows(self.slab, slots, blocks.cpu(), list(new.values()))
                for slot in slots:
                    self._gen[slot] += 1
                    self._pending[slot] = int(self._gen[slot])
                self._work.notify()
            for key, slot in zip(reversed(list(new)), reversed(slots)):
                self._slot_of[key] = slot
            for key in reversed(keys):  # the batch's head ends most recently used
                if key in self._slot_of:
                    self._slot_of.move_to_end(key)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        _, slot = self._slot_of.popitem(last=False)
        self._stats.evictions += 1
        return slot

    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]:
        found = [False] * len(keys)
        with self._lock:
            rows, slots = [], []
            for row, key in enumerate(keys):
                slot = self._slot_of.get(key)
                if slot is None:
                    if prefix:
                        break
                    continue
                rows.append(row)
                slots.append(slot)
            crcs = copy_and_crc(out, rows, self.slab, slots)  # check the copy the caller gets
            for row, slot, crc in zip(rows, slots, crcs):
                if self._pending.pop(slot, None) is not None:
                    self._crc[slot] = crc  # written moments ago and not checksummed yet: this is its checksum
                elif crc != int(self._crc[slot]):
                    self._stats.checksum_failures += 1
                    self._drop(keys[row])
                    if prefix:
                        break
                    continue
                found[row] = True
            for row in reversed(rows):
                if found[row]:
                    self._slot_of.move_to_end(keys[row])
        return found

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = self._check_keys(keys)
        with self._lock:
            return [key in self._slot_of for key in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = self._check_keys(keys)
        with self._lock:
            for key in keys:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def _checksum_loop(self) -> None:
        """Take the CRC32C of freshly written slots, from the slab, off the writer's thread."""
        slab = self.slab.numpy()
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                batch = list(self._pending.items())[:256]
            done = [(slot, gen, crc32c.crc32c(slab[slot])) for slot, gen in batch]
            with self._lock:
                for slot, gen, crc in done:
                    if self._pending.get(slot) == gen and self._gen[slot] == gen:  # not rewritten meanwhile
                        self._crc[slot] = crc
                        del self._pending[slot]
                if not self._pending:
                    self._work.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every stored block has its checksum; False if `timeout` passed first."""
        with self._lock:
            return self._work.wait_for(lambda: not self._pending or self._closed, timeout)

    def _refresh_stats(self) -> None:
        self._stats.blocks = len(self._slot_of)
        self._stats.bytes = len(self._slot_of) * self.bytes_per_block

    def close(self) -> None:
        """Release the slab; tensors returned by `get` are copies and stay valid."""
        with self._lock:
            self._closed = True
            self._work.notify_all()
        if self._checksummer is not None:
            self._checksummer.join()
        with self._lock:
            self._pending.clear()
            self._slot_of.clear()
            self._free = []
            del self.slab
            self.arena.close()
