"""`KVMigrator`: moves block bytes between the device pool and the tiers, as `MigrationPolicy` decides.

- **demote** (`on_evict`, called by the block manager before an evicted slot is reused):
  the batch is copied out of the pool with one read, the policy places each block, and the
  moves are applied deepest first, so every store has made room before a block lands in
  it; each tier then gets one `put` for the whole batch.
- **promote ahead of need** (`TierSource.promote`): blocks a lookup keeps finding below the device
  (the hotspot set) are loaded into free device blocks while the engine has room, so the
  next request that wants them hits the device instead of waiting for a load.

Health (a store that failed rests for a while) and counters belong to the `HierarchyManager`
that owns this migrator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sage_infer.kv_policy.migration import BlockMeta
from sage_infer.kv_runtime.block_rows import engine_move_threads
from sage_infer.kv_runtime.tiers.rows import ChunkGather
from sage_infer.kv_runtime.tiers.tier_errors import TierError
from sage_infer.prefix_reuse.index import EvictedBlock

if TYPE_CHECKING:
    from sage_infer.kv_runtime.hierarchy import HierarchyManager
    from sage_infer.kv_runtime.pool import KVPool

HOT_AFTER_HITS = 2  # default: a block loaded from below this many times is hot, promoted when there is room
MAX_HOT_KEYS = 4096  # lookups remembered for the hotspot set (least recent forgotten first)


@dataclass(frozen=True, slots=True)
class HotBlock:
    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_key: bytes
    depth: int


@dataclass(slots=True)
class MigratorStats:
    hot_promoted: int = 0  # hot blocks loaded into free device blocks ahead of need
    hot_used: int = 0  # of those, hit on the device by a later request
    hot_wasted: int = 0  # of those, evicted again before any request hit them


@dataclass(frozen=True, slots=True)
class From:
    """A block placed in a tier that still sits in lower store `level` (read out at the batch's end)."""

    level: int


# a block placed in a tier, not yet put: its device block id, its bytes (``[n]`` uint8), or where it sits
Placed = int | torch.Tensor | From


@dataclass(slots=True)
class Demotion:
    """One `on_evict`'s moves, applied at its end (`KVMigrator._finish`)."""

    placed: dict[int, dict[bytes, Placed]] = field(default_factory=dict)  # level -> blocks placed there
    take: dict[int, dict[bytes, None]] = field(default_factory=dict)  # level -> blocks leaving that store
    drop: dict[int, list[bytes]] = field(default_factory=dict)  # level -> blocks dropped from that store


def rows_gather(rows: list[torch.Tensor]) -> Callable[[list[int], torch.Tensor], None]:
    """A `KVTier.put_gather` source over separate block rows: one concatenation into the store's buffer."""

    def gather(picked: list[int], out: torch.Tensor) -> None:
        torch.cat([rows[i].reshape(1, -1) for i in picked], out=out)

    return gather


def pool_gather(pool: KVPool, block_ids: list[int]) -> Callable[[list[int], torch.Tensor], None]:
    """A `KVTier.put_gather` source: rows `rows` of the batch are device blocks ``block_ids[rows]``, gathered
    from the pool into the store's buffer with one read per call. Made and called on the engine thread (a
    demotion before an evicted block is reused, a write-through), which waits for it: a large one-pass gather
    splits over torch's threads."""

    def gather(rows: list[int], out: torch.Tensor) -> None:
        ids = block_ids if len(rows) == len(block_ids) else [block_ids[r] for r in rows]
        pool.read_blocks(ids, out=out.view(pool.dtype).view(len(rows), *pool.block_shape))

    chunks = pool.block_chunks(block_ids) if block_ids else None
    # (a store may checksum as it gathers)
    return gather if chunks is None else ChunkGather(*chunks, gather, engine_move_threads())


class KVMigrator:
    """Demotion of evicted device blocks and promotion of hot ones, for one `HierarchyManager`."""

    def __init__(self, hierarchy: HierarchyManager, hot_after: int = HOT_AFTER_HITS) -> None:
        self.hierarchy = hierarchy
        self.hot_after = hot_after  # 0: no hotspot promotion
        self.pool = hierarchy.pool
        self.migration = hierarchy.migration
        self.stats = MigratorStats()
        self.promoted_ahead: set[bytes] = set()  # hot blocks promoted and not yet hit on the device
        self.lower_hits: Counter[bytes] = Counter()  # key -> times admission loaded it from below the device
        self.hot_meta: dict[bytes, HotBlock] = {}
        # a hot block was demoted since promotion last found nothing (more) to place: worth another look
        self.hot_changed = False  # hot blocks demoted since: what registering them again needs

    # -- demote ---------------------------------------------------------------------------------

    def on_evict(self, blocks: list[EvictedBlock]) -> None:
        """The device is about to reuse these blocks' slots: let the policy place each, in eviction order, then
        apply the batch's moves store by store (`_finish`): one read and one delete per store that blocks leave,
        one put per store that blocks enter, the device's gathered from the pool straight into the store's own
        buffer (`KVTier.put_gather`), all before this returns and the slots are reused."""
        batch = Demotion()
        moves: list[tuple[bytes, int, int | None]] = []  # (key, from level, to level or None: dropped)
        self.migration.listener = lambda key, src, dst: moves.append((key, src, dst))
        try:
            for block in blocks:
                moves.clear()
                if block.block_hash in self.promoted_ahead:
                    self.promoted_ahead.discard(block.block_hash)
                    self.stats.hot_wasted += 1
                self._remember_if_hot(block)
                self.migration.demote(block.block_hash, BlockMeta(block.depth, block.parent_hash,
                                                                  self.pool.block_size, block.extra_key))
                # deepest first, as the policy made room: a tier's victims leave before the block that displaced them
                for key, src, dst in reversed(moves):
                    self._apply(key, src, dst, block.block_id if src == 0 else None, batch)
        finally:
            self.migration.listener = None
        self._finish(batch)

    def _apply(self, key: bytes, src: int, dst: int | None, data: Placed | None, batch: Demotion) -> None:
        """Record the move of `key` from level `src` to `dst` (None: drop); `data` is its device block id when src
        is the device. Nothing touches a store here: a block placed and moved on within the same batch never
        touches the store it passed through, and a block leaving a lower store is read out with the others."""
        h = self.hierarchy
        waiting = batch.placed.get(src, {}) if src > 0 else {}
        if data is None:  # between lower tiers: what the batch placed at src, or the store holding it
            data = waiting.pop(key) if key in waiting else From(src)
            if isinstance(data, From):
                batch.take.setdefault(data.level, {})[key] = None
        if dst is None or not h.usable(h.store(dst)):
            if isinstance(data, From):  # its store still holds it: let it go there (a shared store evicts alone)
                del batch.take[data.level][key]
                if not h.store(data.level).shared:
                    batch.drop.setdefault(data.level, []).append(key)
            h.stats.dropped_blocks += 1
            if dst is None:
                self._forget_hot(key)
            else:
                self.forget(key, dst)
            return
        batch.placed.setdefault(dst, {})[key] = data

    def _finish(self, batch: Demotion) -> None:
        """Apply a batch's moves: read out (and delete) what leaves each lower store, delete what is dropped, then
        one put per store; a block its source lost meanwhile (or a source that failed) is forgotten."""
        h = self.hierarchy
        taken: dict[bytes, torch.Tensor | None] = {}
        for level, keys in batch.take.items():
            if not keys:
                continue
            try:
                taken.update(zip(keys, h.store(level).get(list(keys))))  # one read for all of them
                h.store(level).delete(list(keys))
            except TierError as err:
                h.failed(level, err)
        for level, keys in batch.drop.items():
            try:
                h.store(level).delete(keys)
            except TierError as err:
                h.failed(level, err)
        for level, placed in batch.placed.items():
            ready: dict[bytes, Placed] = {}
            for key, data in placed.items():
                if isinstance(data, From):
                    data = taken.get(key)
                    if data is None:  # the source store lost it (its own eviction, corruption, a failure)
                        self.forget(key, level)
                        continue
                ready[key] = data
            if ready:
                self._put(level, ready)

    def _put(self, level: int, placed: dict[bytes, Placed]) -> None:
        """The blocks the batch placed at `level`: the device's gathered from the pool into the store in one
        `put_gather`, the ones moved from another tier in one `put`."""
        h = self.hierarchy
        h.poll_background()  # a store whose writes fail in the background rests before it is given more
        store = h.store(level)
        keys = list(placed)
        device = {key: at for key, at in placed.items() if isinstance(at, int)}
        moved = {key: rows for key, rows in placed.items() if not isinstance(rows, int)}
        try:
            if device:
                store.put_gather(list(device), pool_gather(self.pool, list(device.values())))
            if moved:
                store.put_gather(list(moved), rows_gather(list(moved.values())))
        except TierError as err:
            h.failed(level, err)
            for key in keys:
                self.forget(key, level)
            return
        h.stats.tiers[store.name].demoted_blocks += len(keys)

    def forget(self, key: bytes, level: int) -> None:
        """The policy placed `key` at `level` but its bytes are not there: drop the decision too."""
        tier = self.migration.tiers[level - 1]
        if key in tier:
            tier.pop(key)
        self._forget_hot(key)

    # -- hotspot set ----------------------------------------------------------------------------

    def saw_below(self, keys: list[bytes]) -> None:
        """Admission loaded `keys` from below the device: count them toward the hotspot set."""
        if not self.hot_after:
            return
        for key in keys:
            self.lower_hits[key] += 1
        if len(self.lower_hits) > MAX_HOT_KEYS:  # keep the hottest half
            for key, _ in self.lower_hits.most_common()[MAX_HOT_KEYS // 2 :]:
                del self.lower_hits[key]
                self.hot_meta.pop(key, None)

    def used_on_device(self, keys: list[bytes]) -> None:
        """Admission hit `keys` on the device: count the ones promoted ahead of need."""
        if self.promoted_ahead:
            for key in keys:
                if key in self.promoted_ahead:
                    self.promoted_ahead.discard(key)
                    self.stats.hot_used += 1

    def _remember_if_hot(self, block: EvictedBlock) -> None:
        """A hot block is leaving the device: keep what registering it again needs (tokens, parent, tenant)."""
        if self.hot_after and self.lower_hits.get(block.block_hash, 0) >= self.hot_after:
            self.hot_changed = True
            self.hot_meta[block.block_hash] = HotBlock(block.block_hash, block.parent_hash, block.token_ids,
                                                       block.extra_key, block.depth)

    def hot_below(self) -> list[HotBlock]:
        """Hot blocks that a lower tier holds now, parents before children (so a chain is promoted from its top)."""
        hot = [b for b in self.hot_meta.values() if self.migration.tier_of(b.key) is not None]
        hot.sort(key=lambda b: (b.depth, -self.lower_hits.get(b.key, 0)))
        return hot

    def _forget_hot(self, key: bytes) -> None:
        self.hot_meta.pop(key, None)
