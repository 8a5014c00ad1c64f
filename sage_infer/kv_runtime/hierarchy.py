"""`HierarchyManager`: the device pool plus the tiers below it (host DRAM, local disk, remote).

Decisions and bytes are kept apart. *Which* tier holds a block is decided by
`kv_policy.MigrationPolicy` — the object `sage kv replay --tiers` drives too — over exclusive
lower tiers sized in blocks like the stores below them. *The bytes* live in the tier stores
(`kv_runtime/tiers/`), moved here:

- **demote** (`on_evict`, called by the block manager before an evicted slot is reused):
  the block is copied out of the pool, then the policy's moves are applied deepest first,
  so every store has made room before a block lands in it;
- **lookup** (pure): how many blocks of a chain, right after the device's prefix, the lower
  tiers hold;
- **load**: those blocks come back into freshly allocated device blocks. A tier returns the
  longest *verified* prefix (CRC32C per block), so a miss, a corrupt block or a dead backend
  only shortens the hit: the caller recomputes the rest, never reads wrong KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sage_infer.core.messages import TierSnapshot
from sage_infer.kv_policy.migration import BlockMeta, LowerTier, MigrationPolicy
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.tiers.base import KVTier
from sage_infer.kv_runtime.tiers.errors import TierError
from sage_infer.prefix_reuse.index import EvictedBlock

log = logging.getLogger("sage_infer.kv_runtime")
ROLE = {"redis": "remote"}  # store name -> the tier role the cost model prices
RETRY_AFTER_S = 5.0  # a store that failed is skipped this long before it is tried again


@dataclass(slots=True)
class TierCounters:
    """Per-tier traffic the hierarchy caused (the stores keep their own lower-level counters)."""

    demoted_blocks: int = 0  # blocks written into this tier
    loaded_blocks: int = 0  # blocks read back from this tier into the device
    errors: int = 0  # calls that raised TierError (unreachable backend)


@dataclass(slots=True)
class ReadSegment:
    """What one store returned for a run of a chain: `rows` ``[n, block_nbytes]`` uint8, or the error."""

    level: int
    rows: torch.Tensor | None
    error: TierError | None


@dataclass(slots=True)
class HierarchyStats:
    dropped_blocks: int = 0  # evicted from the device (or a tier) and kept nowhere below
    load_failures: int = 0  # blocks a lookup found but no tier returned verified: recomputed
    tiers: dict[str, TierCounters] = field(default_factory=dict)

    @property
    def demoted_blocks(self) -> int:
        return sum(t.demoted_blocks for t in self.tiers.values())

    @property
    def loaded_blocks(self) -> int:
        return sum(t.loaded_blocks for t in self.tiers.values())


class HierarchyManager:
    """Lower tiers of one device pool, fastest first. `migration.tiers[i]` decides for `stores[i]`."""

    def __init__(self, pool: KVPool, stores: Sequence[KVTier], migration: MigrationPolicy) -> None:
        if len(stores) != len(migration.tiers):
            raise ValueError(f"{len(stores)} tier stores for {len(migration.tiers)} migration tiers")
        for store in stores:
            if store.bytes_per_block != pool.block_nbytes:
                raise ValueError(f"tier {store.name} holds {store.bytes_per_block}-byte blocks, the pool's are "
                                 f"{pool.block_nbytes} bytes")
        self.pool = pool
        self.stores = list(stores)
        self.migration = migration
        self.level_of = {tier.name: level for level, tier in enumerate(migration.tiers, 1)}
        self.stats = HierarchyStats(tiers={store.name: TierCounters() for store in stores})
        self._down_until: dict[str, float] = {}
        self._down_reason: dict[str, str] = {}

    @classmethod
    def build(cls, pool: KVPool, stores: Sequence[KVTier], make_policy, cost=None) -> HierarchyManager:
        """Size one exclusive `LowerTier` per store by how many blocks the store holds."""
        tiers = []
        for store in stores:
            blocks = max(1, store.capacity_bytes // store.bytes_per_block)
            tiers.append(LowerTier(ROLE.get(store.name, store.name), blocks, make_policy(blocks)))
        return cls(pool, stores, MigrationPolicy(tiers, cost))

    def describe(self) -> str:
        """One start-up line: the tiers, their sizes, and what decides a demotion (with the numbers)."""
        sizes = ", ".join(f"{s.name} {s.capacity_bytes / (1 << 30):.2f} GiB ({t.capacity_blocks} blocks)"
                          for s, t in zip(self.stores, self.migration.tiers))
        cost = self.migration.cost
        if cost is None:
            return f"tiers = {sizes} (every evicted block is demoted: no hardware preset to weigh it)"
        bs, depth = self.pool.block_size, 0
        verdicts = []
        for tier in self.migration.tiers:
            recompute = cost.recompute_seconds(bs, depth) * 1e6
            load = cost.load_seconds(tier.name, cost.kv_bytes(bs)) * 1e6
            keep = "demote" if cost.worth_loading(tier.name, bs, depth) else "drop"
            verdicts.append(f"{tier.name}: load {load:.1f} us vs recompute {recompute:.1f} us -> {keep}")
        return (f"tiers = {sizes} (a first {bs}-token block, by the preset's cost model: "
                f"{'; '.join(verdicts)}; deeper blocks cost more to recompute)")

    def _store(self, level: int) -> KVTier:
        """The store of migration level `level` (1 = the first tier below the device)."""
        return self.stores[level - 1]

    # -- demote ---------------------------------------------------------------------------------

    def on_evict(self, blocks: list[EvictedBlock]) -> None:
        """The device is about to reuse these blocks' slots: copy them out (one read) and let the policy
        place each, in eviction order; the stores then get one `put` per tier for the whole batch."""
        data = self.pool.read_blocks([b.block_id for b in blocks]).view(torch.uint8).reshape(len(blocks), -1)
        pending: dict[int, dict[bytes, torch.Tensor]] = {}  # level -> blocks placed there, not yet put
        moves: list[tuple[bytes, int, int | None]] = []  # (key, from level, to level or None: dropped)
        self.migration.listener = lambda key, src, dst: moves.append((key, src, dst))
        try:
            for i, block in enumerate(blocks):
                moves.clear()
                self.migration.demote(block.block_hash,
                                      BlockMeta(block.depth, block.parent_hash, self.pool.block_size))
                # deepest first: a tier's victims leave before the block that displaced them arrives
                for key, src, dst in reversed(moves):
                    self._apply(key, src, dst, data[i : i + 1] if src == 0 else None, pending)
        finally:
            self.migration.listener = None
        for level, placed in pending.items():
            if placed:
                self._put(level, placed)

    def _apply(self, key: bytes, src: int, dst: int | None, data: torch.Tensor | None,
               pending: dict[int, dict[bytes, torch.Tensor]]) -> None:
        """Move `key`'s bytes from level `src` to `dst` (None: drop); `data` holds them when src is the device.

        Placements wait in `pending` for one batched `put` per tier; a block placed and moved on
        within the same batch never touches the store it passed through.
        """
        waiting = pending.get(src, {}) if src > 0 else {}
        try:
            if dst is None:
                if key in waiting:
                    del waiting[key]
                elif src > 0:
                    self._store(src).delete([key])
                self.stats.dropped_blocks += 1
                return
            if data is None:  # between lower tiers: take it from where it is
                if key in waiting:
                    data = waiting.pop(key)
                else:
                    got = self._store(src).get([key])[0]
                    self._store(src).delete([key])
                    if got is None:  # the source store lost it (its own eviction, corruption): nothing to move
                        self._forget(key, dst)
                        return
                    data = got.reshape(1, -1)
            if not self._usable(self._store(dst)):
                self._forget(key, dst)
                self.stats.dropped_blocks += 1
                return
            pending.setdefault(dst, {})[key] = data
        except TierError as err:
            self._failed(dst if dst is not None else src, err)
            if dst is not None:
                self._forget(key, dst)

    def _put(self, level: int, placed: dict[bytes, torch.Tensor]) -> None:
        """One `put` of every block the batch placed at `level`."""
        store = self._store(level)
        keys = list(placed)
        try:
            store.put(keys, torch.cat(list(placed.values())))
        except TierError as err:
            self._failed(level, err)
            for key in keys:
                self._forget(key, level)
            return
        self.stats.tiers[store.name].demoted_blocks += len(keys)

    def _forget(self, key: bytes, level: int) -> None:
        """The policy placed `key` at `level` but its bytes are not there: drop the decision too."""
        tier = self.migration.tiers[level - 1]
        if key in tier:
            tier.pop(key)

    def _failed(self, level: int, err: TierError) -> None:
        """Count a store failure and rest the store for `RETRY_AFTER_S`: its blocks are recomputed meanwhile."""
        store = self._store(level)
        self.stats.tiers[store.name].errors += 1
        self._down_until[store.name] = time.monotonic() + RETRY_AFTER_S
        self._down_reason[store.name] = str(err)
        log.warning("KV tier %s failed, skipped for %.0f s: %s", store.name, RETRY_AFTER_S, err)

    # -- lookup and load ------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some lower tier holds (asked of the stores: a restarted disk tier or a
        Redis another server filled count too). Changes nothing; a failing store counts as empty."""
        present = [False] * len(keys)
        for level, store in enumerate(self.stores, 1):
            missing = [i for i, hit in enumerate(present) if not hit]
            if not missing or not self._usable(store):
                continue
            try:
                found = store.contains([keys[i] for i in missing])
            except TierError as err:
                self._failed(level, err)
                continue
            for i, hit in zip(missing, found):
                present[i] = hit
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def fetch(self, keys: Sequence[bytes]) -> torch.Tensor:
        """Take `keys` (a chain's next blocks) out of the tiers: ``[k, block_nbytes]`` uint8, the verified prefix.

        `read` then `claim` on the calling thread; `kv_runtime.loader` runs `read` on its own thread.
        Fetched blocks leave the tiers (they are exclusive) before the caller allocates device
        blocks for them, so the evictions that allocation causes never push out a block being loaded.
        """
        return self.claim(keys, self.read(keys))

    def read(self, keys: Sequence[bytes]) -> list[ReadSegment]:
        """The verified prefix of `keys` as segments, one per store that answered; touches only the stores.

        At each position the fastest store holding the rest of the chain answers with its
        longest verified prefix (one `get_prefix` call); the next store continues where it
        stopped. When no store has the next block verified, the read ends: the caller
        recomputes from there. Safe on a loader thread: the stores lock themselves, and the
        placement bookkeeping waits for `claim` on the engine thread.
        """
        segments: list[ReadSegment] = []
        done = 0
        while done < len(keys):
            progress = 0
            for level, store in enumerate(self.stores, 1):
                if not self._usable(store):
                    continue
                try:
                    rows = store.get_prefix(list(keys[done:]))
                except TierError as err:
                    segments.append(ReadSegment(level, None, err))
                    continue
                progress = rows.shape[0]
                if progress:
                    segments.append(ReadSegment(level, rows, None))
                    break
            if not progress:
                break
            done += progress
        return segments

    def claim(self, keys: Sequence[bytes], segments: list[ReadSegment]) -> torch.Tensor:
        """On the engine thread: move what `read` got out of the tiers' books; the rows, ``[k, block_nbytes]``."""
        parts: list[torch.Tensor] = []
        done = 0
        for segment in segments:
            if segment.error is not None:
                self._failed(segment.level, segment.error)
                continue
            n = segment.rows.shape[0]
            self._promoted(segment.level, list(keys[done : done + n]))
            parts.append(segment.rows)
            done += n
        if done < len(keys):
            self.stats.load_failures += len(keys) - done
        if not parts:
            return torch.empty((0, self.pool.block_nbytes), dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy fetched rows (``[k, block_nbytes]`` uint8) into device blocks, bit-exact."""
        blocks = rows.view(self.pool.dtype).reshape(rows.shape[0], *self.pool.block_shape)
        self.pool.write_blocks(list(block_ids), blocks)

    def tick(self, now: float) -> None:
        """Advance the lower tiers' policy clocks (time-aware policies), as the device's is."""
        self.migration.tick(now)

    def _promoted(self, level: int, keys: list[bytes]) -> None:
        """`keys` now live on the device: out of the tier (exclusive tiers) and out of the policy's view."""
        store = self._store(level)
        self.stats.tiers[store.name].loaded_blocks += len(keys)
        for key in keys:
            self.migration.promote(key)
        try:
            store.delete(keys)
        except TierError as err:
            self._failed(level, err)

    def _usable(self, store: KVTier) -> bool:
        """False for a while after the store failed, so a dead backend costs one timeout, not one per step."""
        return time.monotonic() >= self._down_until.get(store.name, 0.0)

    def discard(self, keys: Sequence[bytes]) -> None:
        """The device registered `keys` (computed again): forget lower-tier placements so tiers stay exclusive.

        Only placements this process made are dropped; a copy another server put in a shared
        tier stays (it is theirs too), and a stale copy here is only ever a verified duplicate.
        """
        for key in keys:
            tier = self.migration.tier_of(key)
            if tier is None:
                continue
            self.migration.discard(key)
            store = self._store(self.level_of[tier.name])
            try:
                store.delete([key])
            except TierError as err:
                self._failed(self.level_of[tier.name], err)

    def snapshots(self) -> tuple[TierSnapshot, ...]:
        """Every tier's state for stats and /metrics (a store's own `stats()` never raises)."""
        out = []
        for store in self.stores:
            own, counters = store.stats(), self.stats.tiers[store.name]
            down = not self._usable(store)
            out.append(TierSnapshot(
                name=store.name, blocks=own.blocks, bytes=own.bytes, capacity_bytes=own.capacity_bytes,
                demoted_blocks=counters.demoted_blocks, loaded_blocks=counters.loaded_blocks,
                errors=counters.errors, checksum_failures=own.checksum_failures, up=not down,
                down_reason=self._down_reason.get(store.name) if down else None,
            ))
        return tuple(out)

    def close(self) -> None:
        for store in self.stores:
            store.close()
