"""The scheduler's view of the disk tier, which the worker process owns.

vLLM-CPU runs the scheduler-side connector in the engine-core process and the worker-side one
in a separate worker process; a `DiskTier` keeps its index in the memory of the one process
that writes the directory (the worker). The scheduler therefore keeps its own index of keys:
those on disk when it starts (read from the segment headers, nothing loaded) plus those it
has planned to save since, the oldest dropped past the tier's capacity (the tier evicts
oldest first too).

It can be wrong both ways, never unsafely: a key it lists may be gone (evicted in another
order, a save dropped or failed), and then the worker's load misses, reports the blocks and
vLLM recomputes them; a key it lacks is only a missed hit.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers.base import schema_digest
from sage_infer.kv_runtime.tiers.segment import Segment, segment_paths


class DiskKeyIndex:
    """Keys of one disk tier directory as the scheduler believes them stored; speaks `contains` like a tier."""

    name = "disk-index"

    def __init__(self, directory: str | os.PathLike, schema: KVCacheSchema, capacity_bytes: int) -> None:
        self.max_blocks = max(1, capacity_bytes // schema.bytes_per_block)
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        digest = schema_digest(schema)
        for path in segment_paths(Path(directory)):
            try:
                seg = Segment.open(path)
            except FileNotFoundError:  # evicted by the worker meanwhile
                continue
            try:
                for rec in seg.records():
                    if rec.live and rec.digest == digest and rec.length == schema.bytes_per_block:
                        self._keys[rec.key] = None
            finally:
                seg.close()
        self._trim()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._keys for key in keys]

    def add(self, keys: Sequence[bytes]) -> None:
        """Keys the worker is about to save (newest)."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        self._trim()

    def __len__(self) -> int:
        return len(self._keys)

    def _trim(self) -> None:
        while len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)

    def close(self) -> None:
        self._keys.clear()
