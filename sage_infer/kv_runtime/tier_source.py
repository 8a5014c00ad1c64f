"""`TierSource`: the lower KV tiers (host DRAM, disk, Redis / Mooncake) of a `HierarchyManager` as a `KVSource`.

Besides serving a prompt's blocks from below the device (with an optional background reader, `KVLoader`:
a prefetch started when the request is queued), it keeps the tiers in step with the device: evicted blocks
are demoted into them (`attach` wires the block manager's `on_evict`), device hits and newly computed
blocks are reported to them (so the tiers stay exclusive and the write policy sees what it copies), hot
blocks are promoted into free device blocks ahead of need, and a graceful shutdown copies what the cache
holds into the persistent tier.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.block_rows import engine_move_threads
from sage_infer.kv_runtime.hierarchy import HierarchyManager
from sage_infer.kv_runtime.loader import KVLoader
from sage_infer.kv_runtime.prefetch_stats import PrefetchStats
from sage_infer.kv_runtime.sources import KVSource
from sage_infer.prefix_reuse.hashing import extend_chain
from sage_infer.prefix_reuse.index import PrefixMatch

LOWER_LOOKUP_TTL_S = 0.5  # a waiting request's lower-tier lookup is reused this long (see TierSource.lookup)
HOT_RESERVE = 0.10  # fraction of the pool kept free: promotion only uses free blocks beyond it


class TierSource(KVSource):
    """The lower tiers of a `HierarchyManager`: blocks evicted from the device (or kept from a previous run).

    `load_timeout_s`: with a deadline, reads run off the engine thread (prefetch); without, at admission.
    `flush_on_shutdown_s`: `persist`'s time budget (`tiers.flush_on_shutdown_s`).
    """

    name = "tiers"
    counts_as_lower_hit = True
    stages_lower_hits_only = True

    def __init__(self, hierarchy: HierarchyManager, load_timeout_s: float | None = None,
                 flush_on_shutdown_s: float = 30.0) -> None:
        self.hierarchy = hierarchy
        self.pool = hierarchy.pool
        self.flush_on_shutdown_s = flush_on_shutdown_s
        self.loader = KVLoader(hierarchy, load_timeout_s) if load_timeout_s else None
        self.prefetches = self.loader is not None
        self._seen: dict[int, tuple[float, tuple, list[bytes]]] = {}  # seq id -> (when, device prefix, keys)
        self._declined: dict[int, int] = {}  # seq id -> blocks below it will compute, not load (its last lookup)

    def attach(self, block_manager: BlockManager) -> None:
        """Demote what the device evicts into the tiers, before the evicted slots are reused."""
        if block_manager.index is None:
            raise ValueError("KV tiers need prefix caching: blocks are found again by their chained hash")
        self.block_manager = block_manager
        block_manager.on_evict = self.hierarchy.on_evict

    def claims(self, seq: Sequence) -> bool:
        return True

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        """Extend `match` with the chain's next blocks that the lower tiers hold (stops at the first gap).

        A waiting request is matched every step; its lower-tier answer is reused for
        `LOWER_LOOKUP_TTL_S` while its device prefix stays the same, so a remote tier sees one
        lookup per request, not one per step. A stale answer is safe: the load returns the
        verified prefix it finds, and the rest is computed.
        """
        bs = self.pool.block_size
        device = (len(match.block_ids), match.block_hashes[-1] if match.block_hashes else None)
        seen = self._seen.get(seq.seq_id)
        if seen is not None and seen[1] == device and now - seen[0] < LOWER_LOOKUP_TTL_S:
            keys = seen[2]
        else:
            # the chain the device match kept: these blocks' hashes continue its prefix's
            keys = extend_chain(seq.hash_chain, seq.token_ids, bs, seq.extra_key,
                                match.num_query_blocks)[len(match.block_ids) :]
            levels = self.hierarchy.locate(keys)
            # the leading run worth loading; the rest is computed (measured faster than reading it back)
            rates = self.hierarchy.rates
            load = (rates.blocks_to_load(levels, device[0], seq.num_tokens - device[0] * bs) if rates is not None
                    else len(levels))
            keys = keys[:load]
            self._seen[seq.seq_id] = (now, device, keys)
            self._declined[seq.seq_id] = len(levels) - load
        match.lower_block_hashes = list(keys)
        match.num_lower_tokens = len(keys) * bs

    def prefetch(self, seq: Sequence, match: PrefixMatch) -> None:
        """A request entered the waiting queue: start reading its lower-tier prefix now (with a loader)."""
        if self.loader is not None and match.lower_block_hashes and seq.seq_id not in self.loader.pending:
            self.loader.start(seq.seq_id, match.lower_block_hashes, len(match.block_ids))

    def is_loading(self, seq: Sequence) -> bool:
        """Its prefetch is still reading (and within its deadline)."""
        return self.loader is not None and self.loader.is_loading(seq.seq_id)

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        """The blocks out of the tiers, before the device allocates (its evictions demote into them)."""
        self._seen.pop(seq.seq_id, None)
        self.hierarchy.stats.failures["recompute"] += self._declined.pop(seq.seq_id, 0)
        self.hierarchy.tick(now)
        if not match.lower_block_hashes:
            return None
        self.hierarchy.migrator.saw_below(match.lower_block_hashes)
        staged = None
        if self.loader is not None:
            staged = self.loader.take(seq.seq_id, match.lower_block_hashes, len(match.block_ids))
        return staged if staged is not None else self.hierarchy.fetch(match.lower_block_hashes)

    def release(self, rows: torch.Tensor | None) -> None:
        """`take`'s rows are in the pool: their staging buffer serves the next load."""
        self.hierarchy.release(rows)

    def observe_load(self, seconds: float, blocks: int) -> None:
        """Load or compute weighs a load's own cost against what its blocks save."""
        if self.hierarchy.rates is not None:
            self.hierarchy.rates.observe_load(seconds, blocks)

    def on_hit(self, match: PrefixMatch) -> None:
        """The device served these blocks: the hot set and the write policy count the hit."""
        self.hierarchy.migrator.used_on_device(match.block_hashes)
        self.hierarchy.hit(match.block_hashes, match.block_ids)

    def on_computed(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        """The device computed these blocks again: drop their lower-tier copies (the tiers stay exclusive), and
        let the write policy copy them to the persistent tier."""
        self.hierarchy.discard(block_hashes)
        self.hierarchy.computed(block_hashes, block_ids)

    def forget(self, seq: Sequence) -> None:
        if self.loader is not None:
            self.loader.drop(seq.seq_id)
        self._seen.pop(seq.seq_id, None)
        self._declined.pop(seq.seq_id, None)

    def promote(self, limit: int) -> int:
        """Load hot lower-tier blocks into free device blocks ahead of need; returns how many.

        Hot = loaded from below at admission at least `migrator.HOT_AFTER_HITS` times. Only
        free blocks beyond a reserve of `HOT_RESERVE` of the pool are used (promotion never
        evicts), parents before children, and each promoted block is registered as cached:
        the next request with that prefix hits the device, and the room stays available to
        admission like any cached block.
        """
        migrator = self.hierarchy.migrator
        if not migrator.hot_changed:
            return 0  # (this runs after every step: no scan while nothing new became hot)
        manager, index = self.block_manager, self.block_manager.index
        room = min(limit, manager.num_free_blocks - int(manager.num_blocks * HOT_RESERVE))
        if room <= 0:
            return 0
        chosen, placed = [], set()
        for block in migrator.hot_below():
            if len(chosen) >= room:
                break
            if block.parent is None or block.parent in placed or index.block_of(block.parent) is not None:
                chosen.append(block)
                placed.add(block.key)
        migrator.hot_changed = len(chosen) >= room  # a full batch: there may be more for the next step
        if not chosen:
            return 0
        rows = self.hierarchy.fetch([block.key for block in chosen])
        chosen = chosen[: rows.shape[0]]
        if not chosen:
            return 0
        block_ids = manager.allocate(len(chosen))
        self.pool.write_rows(block_ids, rows, engine_move_threads())
        self.hierarchy.release(rows)
        for block_id, block in zip(block_ids, chosen):
            manager.own(block_id, block.extra_key)
        kept = []
        for block_id, block in zip(block_ids, chosen):
            if block.parent is not None and index.block_of(block.parent) is None:
                kept.append(block_id)  # its parent did not come back (a shorter fetch): not reachable
                continue
            block_id, _ = manager.cache_block(block_id, block.parent, block.token_ids, block.extra_key)
            manager.set_num_tokens(block_id, manager.block_size)
            kept.append(block_id)
            migrator.promoted_ahead.add(block.key)
        manager.free(list(reversed(kept)))  # children first: they become cached, evictable leaves
        migrator.stats.hot_promoted += len(chosen)
        return len(chosen)

    def persist(self) -> tuple[int, int]:
        """Copy the device's cached blocks and the faster tiers' into the persistent tier (the disk tier) within
        `flush_on_shutdown_s`, for a restart on the same directory; (written, left out)."""
        return self.hierarchy.persist(self.block_manager.index.registered(), self.flush_on_shutdown_s)

    def poll(self, free: Callable[[Sequence], None]) -> None:
        """Take the tiers' background failures (the disk writer's) into their health and counters."""
        self.hierarchy.poll_background()

    def wait(self, timeout: float) -> bool:
        if self.loader is None or not self.loader.pending:
            return False
        self.loader.wait(timeout)
        return True

    def stats(self) -> dict[str, object]:
        """The tiers' state, load failures and latency, hot promotion and prefetch counters (`EngineStats`)."""
        hierarchy, loads = self.hierarchy, self.loader.stats if self.loader is not None else None
        stats, hot = hierarchy.stats, hierarchy.migrator.stats
        return {"tiers": hierarchy.snapshots(), "tier_dropped_blocks": stats.dropped_blocks,
                "tier_load_failures": stats.load_failures,
                "tier_load_failure_reasons": tuple(stats.failures.items()),
                "tier_load_latency": stats.load_latency.cumulative(), "tier_load_latency_sum": stats.load_latency.total,
                "hot_promoted": hot.hot_promoted, "hot_used": hot.hot_used, "hot_wasted": hot.hot_wasted,
                **prefetch_fields(loads, self.pool.block_nbytes), **rate_fields(hierarchy)}

    def close(self) -> None:
        """Stop the background reader and the tiers' work (the disk tier's writer finishes what it queued)."""
        if self.loader is not None:
            self.loader.close()
        self.hierarchy.close()


def rate_fields(hierarchy: HierarchyManager) -> dict[str, object]:
    """What load-or-compute measured (each tier's read rate, the fitted step and load lines) as `EngineStats`
    fields; empty without it."""
    if hierarchy.rates is None:
        return {}
    reads, step, load = hierarchy.rates.measured()
    fields: dict[str, object] = {"tier_read_bytes_per_s": tuple(
        (store.name, reads[level]) for level, store in enumerate(hierarchy.stores, 1) if level in reads)}
    if step is not None:
        fields["prefill_step_fixed_s"] = step[0]
        fields["prefill_marginal_flops"] = 1.0 / step[1] if step[1] else float("inf")
    if load is not None:
        fields["tier_load_fixed_s"], fields["tier_load_block_s"] = load
    return fields


def prefetch_fields(loads: PrefetchStats | None, block_nbytes: int) -> dict[str, object]:
    """A loader's prefetch counters as `EngineStats` fields (zeros without a loader)."""
    loads = loads or PrefetchStats()
    return {"prefetch_issued": loads.issued, "prefetch_used": loads.used, "prefetch_timeouts": loads.timeouts,
            "prefetch_wasted": tuple(loads.wasted.items()), "prefetch_bytes": loads.blocks_read * block_nbytes,
            "prefetch_wasted_bytes": loads.blocks_wasted * block_nbytes}
