"""The scheduler's view of the disk tier, which the worker process owns, ordered by sage's policies.

vLLM-CPU runs the scheduler-side connector in the engine-core process and the worker-side one
in a separate worker process; a `DiskTier` keeps its index in the memory of the one process
that writes the directory (the worker). The scheduler therefore keeps its own index of keys:
those on disk when it starts (read from the segment headers, nothing loaded) plus those it
has planned to save since.

The index is a `kv_policy.LowerTier`, the same object the native engine's tiers are placed
by: capped at the tier's capacity in blocks, ordered by an eviction policy (`eviction`: lru,
lfu, arc, s3fifo, sage), with tenant quotas (`QuotaManager`, tenants by ``cache_salt``) when
configured. A save that overflows it evicts the policy's victims; the scheduler sends their
keys to the worker, which deletes them from the disk before it writes the new blocks. Loads
count as hits for the policy. Blocks found on disk at start-up have no known tenant (the key
does not reveal it): they count as the default tenant's.

It can be wrong both ways, never unsafely: a key it lists may be gone (a save dropped or
failed, the disk tier's own segment eviction), and then the worker's load misses, reports
the blocks and vLLM recomputes them; a key it lacks is only a missed hit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.migration import BlockMeta, LowerTier
from sage_infer.kv_policy.quota import QuotaManager
from sage_infer.kv_runtime.tiers.base import schema_digest
from sage_infer.kv_runtime.tiers.segment import Segment, segment_paths

TIER = "disk"


class DiskKeyIndex:
    """Keys of one disk tier directory as the scheduler believes them stored; speaks `contains` like a tier."""

    name = "disk-index"

    def __init__(self, directory: str | os.PathLike, schema: KVCacheSchema, capacity_bytes: int,
                 eviction: str = "lru", quota: QuotaManager | None = None) -> None:
        self.max_blocks = max(1, capacity_bytes // schema.bytes_per_block)
        self.block_tokens = schema.block_size
        self.tier = LowerTier(TIER, self.max_blocks, make_policy(eviction, capacity=self.max_blocks), quota)
        self.evicted = 0
        digest = schema_digest(schema)
        found: list[bytes] = []
        for path in segment_paths(Path(directory)):
            try:
                seg = Segment.open(path)
            except FileNotFoundError:  # evicted by the worker meanwhile
                continue
            try:
                found.extend(rec.key for rec in seg.records()
                             if rec.live and rec.digest == digest and rec.length == schema.bytes_per_block)
            finally:
                seg.close()
        for key in found[-self.max_blocks:]:  # the newest, oldest first
            if key not in self.tier:
                self.tier.insert(key, BlockMeta(0, None, self.block_tokens))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self.tier for key in keys]

    def add(self, keys: Sequence[bytes], first: int = 0, parent: bytes | None = None, tenant: bytes = b""
            ) -> list[bytes]:
        """Keys the worker is about to save (chain positions from `first`, `tenant`'s): the keys the policy
        evicts to make room, which the worker must delete first."""
        evicted: list[bytes] = []
        for i, key in enumerate(keys):
            if key in self.tier:
                self.tier.policy.on_hit(key)
            else:
                victims = self.tier.insert(key, BlockMeta(first + i, parent, self.block_tokens, tenant))
                evicted.extend(victim for victim, _ in victims)
            parent = key
        self.evicted += len(evicted)
        return evicted

    def hit(self, keys: Sequence[bytes]) -> None:
        """The worker loads these: the policy sees a use."""
        for key in keys:
            if key in self.tier:
                self.tier.policy.on_hit(key)

    def __len__(self) -> int:
        return len(self.tier)

    def close(self) -> None:
        for key in list(self.tier.blocks):
            self.tier.pop(key)
