"""`HostTier`: KV blocks in host DRAM, in one preallocated slab.

Layout: ``slab: [num_slots, bytes_per_block]`` uint8, carved once from a `SharedArena`
(memfd-backed), so the transport can later send a block straight from its slot without a
copy, and pinned in place when CUDA is present (`pinned.pin_host_memory`). A free-slot
stack, ``key -> slot`` and one CRC32C per slot are all the bookkeeping: no allocation
after start-up.

Eviction is LRU by last access (put or hit). Within one batch, later keys count as older,
so a chain of blocks loses its tail before its head (the head is what every load needs).

Where the KV codec's C++ kernel loads, a `put` of a batch copies and checksums its blocks in one
pass (`rows.copy_runs`: each byte loaded once), and so does a `put_gather` from the KV pool
(`rows.ChunkGather`). Elsewhere the checksums of a large `put` (4 MiB
or more) are taken off the caller's thread: the put is one memcpy per run of slots, and a checksum
thread takes each new slot's CRC32C from the slab right after (`drain` waits for it); a small put
checksums each ~1 MiB run as it copies it, while it is in cache, which is faster than handing it
over. A read of a slot whose checksum
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
from sage_infer.kv_runtime.tiers.pinned import pin_host_memory, pin_status, unpin_host_memory
from sage_infer.kv_runtime.tiers.rows import (
    ChunkGather,
    Gather,
    copy_runs,
    crc_runs,
    fused_kernel,
    runs_of,
    tensor_gather,
)
from sage_infer.transport.arena import SharedArena

# below this much per put, copy + checksum in cache beats handing the checksums to the thread; above it the
# thread wins (`bench/tiers_raw.py`: "put, crc inline" against "put, crc on thread")
BACKGROUND_CRC_MIN_BYTES = 4 << 20


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first batch row, count) for each run of consecutive slots of an ascending `slots`."""
    return [(d, s, n) for d, s, n in runs_of(slots, range(len(slots)))]


class HostTier(KVTier):
    """A bounded DRAM store of ``capacity_bytes // bytes_per_block`` KV blocks."""

    def __init__(self, schema: KVCacheSchema, capacity_bytes: int, *, name: str = "host", pin: bool = True,
                 background_crc: bool = True, background_min_bytes: int = BACKGROUND_CRC_MIN_BYTES) -> None:
        super().__init__(schema, capacity_bytes, name)
        self.num_slots = self.capacity_bytes // self.bytes_per_block
        self.arena = SharedArena(self.num_slots * self.bytes_per_block)
        self.slab = self.arena.tensor((self.num_slots, self.bytes_per_block), torch.uint8)
        self.pinned = pin_host_memory(self.slab) if pin else False
        self.pin_status = pin_status(self.pinned) if pin else "not pinned: pin=False"
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
        self._store(keys, blocks.cpu(), tensor_gather(blocks))

    def put_gather(self, keys: Sequence[bytes], gather: Gather) -> None:
        """`put` of blocks the caller writes straight into the slab: `gather(rows, out)` fills each run of free
        slots (one call per run; a fresh or freshly emptied slab gives a batch one run)."""
        self._store(self._check_keys(keys), None, gather)

    def _store(self, keys: list[bytes], blocks: torch.Tensor | None, gather: Gather) -> None:
        with self._lock:
            self._stats.puts += len(keys)
            new_keys, new_rows = self._new_rows(keys)
            slots = self._take_slots(len(new_keys))
            runs = slot_runs(slots)
            consecutive = blocks is not None and all(new_rows[s + n - 1] - new_rows[s] == n - 1 for _, s, n in runs)
            one_pass = fused_kernel() is not None and (consecutive or isinstance(gather, ChunkGather))
            inline = (self._checksummer is None or len(slots) * self.bytes_per_block < self.background_min_bytes
                      or one_pass)  # one pass: nothing left for the thread
            if consecutive:
                # rows consecutive on both sides: copy (and checksum) piece by piece, on threads when large
                crcs = copy_runs(self.slab, blocks, [(d, new_rows[s], n) for d, s, n in runs],
                                 crc_of="dst" if inline else None)
            elif inline and isinstance(gather, ChunkGather) and fused_kernel() is not None:
                # gathered from the pool and checksummed in the same pass: the slab rows are not read again
                crcs = [crc for d, s, n in runs
                        for crc in gather.gather_crc(new_rows[s : s + n], self.slab[d : d + n]).tolist()]
            else:
                for d, s, n in runs:
                    gather(new_rows[s : s + n], self.slab[d : d + n])
                crcs = crc_runs(self.slab, [(d, n) for d, _, n in runs]) if inline else []
            if inline:
                self._crc[slots] = crcs
            else:
                self._gen[slots] += 1
                self._pending.update(zip(slots, self._gen[slots].tolist()))
                self._work.notify()
            self._slot_of.update(zip(reversed(new_keys), reversed(slots)))
            if len(new_keys) != len(keys):  # some were stored already, or repeated: the batch's head ends newest
                for key in reversed(keys):
                    if key in self._slot_of:
                        self._slot_of.move_to_end(key)

    def _new_rows(self, keys: list[bytes]) -> tuple[list[bytes], list[int]]:
        """The batch's keys not stored yet (first occurrence, at most a slab's worth: a chain's head) and their
        rows; stored ones are touched first, so this batch's evictions spare them."""
        slot_of = self._slot_of
        if not any(map(slot_of.__contains__, keys)) and len(set(keys)) == len(keys):
            new_keys, new_rows = keys, list(range(len(keys)))
        else:
            first: dict[bytes, int] = {}
            for row, key in enumerate(keys):
                if key in slot_of:
                    slot_of.move_to_end(key)
                elif key not in first:
                    first[key] = row
            new_keys, new_rows = list(first), list(first.values())
        if len(new_keys) > self.num_slots:  # keep a chain's head: the tail is useless without it
            self._stats.dropped += len(new_keys) - self.num_slots
            new_keys, new_rows = new_keys[: self.num_slots], new_rows[: self.num_slots]
        return new_keys, new_rows

    def _take_slots(self, n: int) -> list[int]:
        """`n` slots, ascending (so a batch lands in runs): free ones first, then the least recently used."""
        take = min(n, len(self._free))
        slots = self._free[len(self._free) - take :]
        del self._free[len(self._free) - take :]
        for _ in range(n - take):
            _, slot = self._slot_of.popitem(last=False)
            slots.append(slot)
        self._stats.evictions += n - take
        slots.sort()
        return slots

    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]:
        with self._lock:
            slots = list(map(self._slot_of.get, keys))
            if prefix and None in slots:
                slots = slots[: slots.index(None)]
            if None in slots:
                rows = [row for row, slot in enumerate(slots) if slot is not None]
                slots = [slots[row] for row in rows]
            else:
                rows = list(range(len(slots)))
            runs = runs_of(rows, slots)
            # the caller's copy checksummed; releasing the GIL per row: reads run on a loader thread, mostly
            crcs = np.array(copy_runs(out, self.slab, runs, crc_of="dst", release_gil=True, spawn=True),
                            dtype=np.uint32)
            ok = crcs == self._crc[slots]
            if self._pending:  # written moments ago and not checksummed yet: this is its checksum
                for i, slot in enumerate(slots):
                    if self._pending.pop(slot, None) is not None:
                        self._crc[slot] = crcs[i]
                        ok[i] = True
            for i in np.flatnonzero(~ok).tolist():
                self._stats.checksum_failures += 1
                self._drop(keys[rows[i]])
            if prefix and not ok.all():
                rows = rows[: int(np.argmin(ok))]
                ok = ok[: len(rows)]
            if len(rows) == len(keys):  # every key stored (rows is 0, 1, 2, ...)
                found = ok.tolist()
            else:
                found = [False] * len(keys)
                for row, good in zip(rows, ok.tolist()):
                    found[row] = good
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
            # releasing the GIL for each row: this thread must not keep the engine thread waiting for it
            done = [(slot, gen, crc32c.crc32c(slab[slot], gil_release_mode=1)) for slot, gen in batch]
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
            if self.pinned:
                unpin_host_memory(self.slab)
                self.pinned = False
            del self.slab
            self.arena.close()
