"""`QueuedPrefetch`: the engine's prefetch of a queued request's lower-tier prefix (`KVLoader`), on a replay.

While one request is admitted and computes, the next one waits in the queue; the engine then starts
reading the next one's lower-tier prefix (the blocks right after its device hit, as long as a lower
tier holds them). At that request's admission, a prefetched block is used when the admission takes it
from a lower tier; one the device now holds was read for nothing (`dropped`: the device prefix moved),
one no tier holds any more too (`evicted`). Counted with the engine's own `PrefetchStats`.
"""

from __future__ import annotations

from sage_infer.kv_policy.migration import MigrationPolicy
from sage_infer.kv_runtime.prefetch_stats import PrefetchStats
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.prefix_reuse.index import PrefixReuseIndex


class QueuedPrefetch:
    """One request of lookahead: `issue` for the queued request, `settle` at its admission."""

    def __init__(self, extra_key: bytes) -> None:
        self.extra_key = extra_key
        self.stats = PrefetchStats()
        self._pending: list[bytes] = []

    def issue(self, hash_ids: list[int], index: PrefixReuseIndex, migration: MigrationPolicy) -> None:
        """The queued request's chain past its device prefix, while a lower tier holds it (read-only lookups)."""
        chain, keys = None, []
        for token in hash_ids:
            chain = hash_block(chain, (token,), self.extra_key)
            if not keys and index.block_of(chain) is not None:
                continue  # still the device prefix
            if migration.tier_of(chain) is None:
                break
            keys.append(chain)
        self._pending = keys
        if keys:
            self.stats.issue(len(keys))

    def settle(self, loaded: list[bytes], device: list[bytes]) -> None:
        """Its admission took `loaded` from the lower tiers and hit `device` on the device."""
        keys, self._pending = self._pending, []
        if not keys:
            return
        used = len(set(keys).intersection(loaded))
        if used:
            self.stats.use(used, len(keys))
        else:
            self.stats.waste("dropped" if set(keys).intersection(device) else "evicted", len(keys))

    def to_json(self, block_bytes: int) -> dict:
        s = self.stats
        return {"issued": s.issued, "used": s.used, "hit_ratio": s.hit_ratio, "wasted": dict(s.wasted),
                "blocks_read": s.blocks_read, "blocks_wasted": s.blocks_wasted,
                "bytes_read": s.blocks_read * block_bytes, "bytes_wasted": s.blocks_wasted * block_bytes}
