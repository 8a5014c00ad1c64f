"""`HierarchyManager`: the device pool plus the tiers below it (host DRAM, local disk, remote).

Decisions and bytes are kept apart. *Which* tier holds a block is decided by
`kv_policy.MigrationPolicy` — the object `sage kv replay --tiers` drives too — over exclusive
lower tiers sized in blocks like the stores below them. *The bytes* live in the tier stores
(`kv_runtime/tiers/`):

- **demote** and **promote ahead of need**: `kv_runtime.migrator.KVMigrator` (`on_evict`);
- **lookup** (pure): how many blocks of a chain, right after the device's prefix, the lower
  tiers hold;
- **load**: those blocks come back into freshly allocated device blocks. A tier returns the
  longest *verified* prefix (CRC32C per block), so a miss, a corrupt block or a dead backend
  only shortens the hit: the caller recomputes the rest, never reads wrong KV.
- **write through** (`tiers.write_policy`): besides the exclusive placements above, the persistent
  store (the disk tier) keeps a copy of every block the device computes (`write_through`) or of
  every block its prefix cache hit twice (`write_through_selective`), written in the background,
  so a crash loses only the writes in flight. Those copies stay when the block is loaded or
  computed again; the disk tier's own size cap ages them out.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sage_infer.core.messages import TierSnapshot
from sage_infer.kv_policy.load_or_compute import LoadOrCompute
from sage_infer.kv_policy.migration import LowerTier, MigrationPolicy
from sage_infer.kv_runtime.migrator import KVMigrator, pool_gather
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.staging import StagingBuffers
from sage_infer.kv_runtime.tiers.base import KVTier
from sage_infer.kv_runtime.tiers.tier_errors import TierError

log = logging.getLogger("sage_infer.kv_runtime")
ROLE = {"redis": "remote", "mooncake": "remote"}  # store name -> the tier role the cost model prices
RETRY_AFTER_S = 5.0  # a store that failed is skipped this long before it is tried again
PERSIST_BATCH = 256  # blocks per put when a shutdown copies the faster levels into the persistent store
SELECTIVE_HITS = 2  # write_through_selective: device prefix-cache hits that earn a block its disk copy
MAX_COUNTED_HITS = 65536  # blocks whose hits write_through_selective remembers (the oldest half forgotten first)


@dataclass(slots=True)
class TierCounters:
    """Per-tier traffic the hierarchy caused (the stores keep their own lower-level counters)."""

    demoted_blocks: int = 0  # blocks written into this tier
    written_through_blocks: int = 0  # device blocks copied into it by a write-through policy
    loaded_blocks: int = 0  # blocks read back from this tier into the device
    errors: int = 0  # calls that raised TierError (unreachable backend)


@dataclass(slots=True)
class ReadSegment:
    """What one store returned for a run of a chain: `rows` ``[n, block_nbytes]`` uint8, or the error.

    `corrupt`: the store found a bad checksum during this read (it ended the run there).
    """

    level: int
    rows: torch.Tensor | None
    error: TierError | None
    corrupt: bool = False


LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# recompute: found, but computing them again was measured faster than loading them (`kv_policy.load_or_compute`)
FAILURE_REASONS = ("miss", "corrupt", "error", "timeout", "recompute")


@dataclass(slots=True)
class LoadLatency:
    """A histogram of lower-tier read latencies (seconds), filled on the loader thread and the engine's."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))  # last: +Inf
    total: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LOAD_BUCKETS, seconds)
        with self.lock:
            self.counts[i] += 1
            self.total += seconds

    def cumulative(self) -> tuple[tuple[float, int], ...]:
        """``((upper bound, observations <= it), ...)`` ending with +Inf, as Prometheus wants."""
        with self.lock:
            counts = list(self.counts)
        out, running = [], 0
        for bound, n in zip((*LOAD_BUCKETS, float("inf")), counts):
            running += n
            out.append((bound, running))
        return tuple(out)


@dataclass(slots=True)
class HierarchyStats:
    dropped_blocks: int = 0  # evicted from the device (or a tier) and kept nowhere below
    # blocks a lookup found but no tier returned verified (recomputed), by reason: a miss (gone
    # meanwhile), corrupt (bad CRC32C), error (the store failed), timeout (past the load deadline),
    # recompute (not loaded: computing them was measured faster)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    load_latency: LoadLatency = field(default_factory=LoadLatency)

    @property
    def load_failures(self) -> int:
        return sum(self.failures.values())

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
        self.rates: LoadOrCompute | None = None  # measured read and prefill speeds (set by the engine's builder)
        self._down_until: dict[str, float] = {}
        self._down_reason: dict[str, str] = {}
        self.migrator = KVMigrator(self)
        self.staging = StagingBuffers(pool.block_nbytes, pin=pool.device.type == "cuda")  # `read`'s buffers
        self.on_evict = self.migrator.on_evict  # the block manager's eviction hook
        self.write_policy = "write_back"  # tiers.write_policy; the others need a persistent store
        # the level of the first store whose blocks outlive this process (the disk tier), None without one
        self.persistent_level = next((i for i, store in enumerate(self.stores, 1) if store.persistent), None)
        self._hits: dict[bytes, int] = {}  # write_through_selective: device hits per block not yet copied
        self.remote_write_through = False  # tiers.remote_write_policy write_through: the shared store gets copies too
        self.shared_level = next((i for i, store in enumerate(self.stores, 1) if store.shared), None)
        # hears the keys a write-through copies into the shared store (the engine's KV events: every server sees them)
        self.on_shared_copy: Callable[[bytes], None] | None = None

    @classmethod
    def build(cls, pool: KVPool, stores: Sequence[KVTier], make_policy, cost=None, quota=None) -> HierarchyManager:
        """Size one exclusive `LowerTier` per store by how many blocks the store holds (`quota`: tenant shares)."""
        tiers = []
        for store in stores:
            blocks = max(1, store.capacity_bytes // store.bytes_per_block)
            tiers.append(LowerTier(ROLE.get(store.name, store.name), blocks, make_policy(blocks), quota))
        return cls(pool, stores, MigrationPolicy(tiers, cost))

    def describe(self) -> str:
        """One start-up line: the tiers, their sizes, and what decides a demotion (with the numbers)."""
        sizes = ", ".join(f"{s.name} {s.capacity_bytes / (1 << 30):.2f} GiB ({t.capacity_blocks} blocks"
                          + (f"; {s.pin_status}" if hasattr(s, "pin_status") else "") + ")"
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

    def store(self, level: int) -> KVTier:
        """The store of migration level `level` (1 = the first tier below the device)."""
        return self.stores[level - 1]

    def failed(self, level: int, err: TierError) -> None:
        """Count a store failure and rest the store for `RETRY_AFTER_S`: its blocks are recomputed meanwhile."""
        store = self.store(level)
        self.stats.tiers[store.name].errors += 1
        self._down_until[store.name] = time.monotonic() + RETRY_AFTER_S
        self._down_reason[store.name] = str(err)
        log.warning("KV tier %s failed, skipped for %.0f s: %s", store.name, RETRY_AFTER_S, err)

    def poll_background(self) -> None:
        """Count and rest the stores whose own background work failed since the last look (the disk tier's writer:
        a full disk, a deleted directory): seen in `sage:kv_tier_errors`, `sage:kv_tier_up` and /health."""
        for level, store in enumerate(self.stores, 1):
            errors = store.take_background_errors()
            if errors:
                more = f" (and {len(errors) - 1} more failures)" if len(errors) > 1 else ""
                self.failed(level, TierError(errors[-1] + more))

    # -- write through --------------------------------------------------------------------------

    def computed(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """The device registered these full blocks (computed, or loaded from below): under `write_through`, copy
        the ones the persistent store lacks into it; under a remote `write_through`, into the shared store too."""
        if self.write_policy == "write_through":
            self._write_through(keys, block_ids)
        if self.remote_write_through and self.shared_level is not None:
            self._write_through(keys, block_ids, self.shared_level)

    def hit(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """The device's prefix cache served these blocks: under `write_through_selective`, a block's second hit
        copies it into the persistent store."""
        if self.write_policy != "write_through_selective" or not keys:
            return
        ready_keys, ready_ids = [], []
        for key, block_id in zip(keys, block_ids):
            hits = self._hits.pop(key, 0) + 1  # (re-inserted: the dict's order is the order of last hits)
            if hits >= SELECTIVE_HITS:
                ready_keys.append(key)
                ready_ids.append(block_id)
            else:
                self._hits[key] = hits
        if len(self._hits) > MAX_COUNTED_HITS:
            for key in list(self._hits)[: MAX_COUNTED_HITS // 2]:
                del self._hits[key]
        if ready_keys:
            self._write_through(ready_keys, ready_ids)

    def _keeps_copies(self, store: KVTier) -> bool:
        """Whether `store` keeps its blocks when the device takes them back (shared, or the write-through copy)."""
        return store.shared or (store.persistent and self.write_policy != "write_back")

    def _write_through(self, keys: Sequence[bytes], block_ids: Sequence[int], level: int | None = None) -> None:
        level = self.persistent_level if level is None else level
        if level is None:
            return
        store = self.store(level)
        self.poll_background()
        if not self.usable(store):
            return
        try:
            missing = [i for i, there in enumerate(store.contains(keys)) if not there]
            if not missing:
                return
            # gathered from the pool into the store's queue (the disk tier's writer thread touches the disk)
            store.put_gather([keys[i] for i in missing], pool_gather(self.pool, [block_ids[i] for i in missing]))
        except TierError as err:
            self.failed(level, err)
            return
        self.stats.tiers[store.name].written_through_blocks += len(missing)
        if level == self.shared_level and self.on_shared_copy is not None:
            for i in missing:
                self.on_shared_copy(keys[i])

    # -- lookup and load ------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some lower tier holds (asked of the stores: a restarted disk tier or a
        Redis another server filled count too). Changes nothing; a failing store counts as empty."""
        return len(self.locate(keys))

    def locate(self, keys: Sequence[bytes]) -> list[int]:
        """The level (1: the fastest lower tier) of the first store holding each of the leading `keys` that some
        store holds. Changes nothing; a failing store counts as empty."""
        levels = self.levels(keys)
        n = 0
        while n < len(levels) and levels[n]:
            n += 1
        return levels[:n]

    def levels(self, keys: Sequence[bytes]) -> list[int]:
        """Per key, the level of the first store holding it, 0 where none does (any keys, not only a chain's next
        ones: the blocks of each KV group a hybrid model's prefix hit needs). One `contains` per store; changes
        nothing; a failing store counts as empty."""
        levels = [0] * len(keys)
        for level, store in enumerate(self.stores, 1):
            missing = [i for i, at in enumerate(levels) if not at]
            if not missing or not self.usable(store):
                continue
            try:
                found = store.contains([keys[i] for i in missing])
            except TierError as err:
                self.failed(level, err)
                continue
            for i, hit in zip(missing, found):
                if hit:
                    levels[i] = level
        return levels

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
        start = time.perf_counter()
        segments: list[ReadSegment] = []
        done = 0
        # one buffer for the whole chain: each store reads its run into the rows after the previous store's, so a
        # chain found in two tiers comes back as one tensor with no second copy; a kept one (`staging`), so the
        # read does not pay for fresh pages (page-locked when the pool is on an accelerator)
        buffer = self.staging.acquire(len(keys))
        while done < len(keys):
            progress = 0
            for level, store in enumerate(self.stores, 1):
                if not self.usable(store):
                    continue
                corrupt_before = store.checksum_failures
                began = time.perf_counter()
                try:
                    rows = store.get_prefix(list(keys[done:]), out=buffer[done:])
                except TierError as err:
                    segments.append(ReadSegment(level, None, err))
                    continue
                progress = rows.shape[0]
                if progress and self.rates is not None:
                    self.rates.observe_read(level, rows.numel() * rows.element_size(), time.perf_counter() - began)
                corrupt = store.checksum_failures > corrupt_before
                if progress or corrupt:
                    segments.append(ReadSegment(level, rows, None, corrupt))
                if progress:
                    break
            if not progress:
                break
            done += progress
        if not done:
            self.staging.release(buffer)
        self.stats.load_latency.observe(time.perf_counter() - start)
        return segments

    def release(self, rows: torch.Tensor | None) -> None:
        """The rows `fetch` / `claim` returned were written into the pool: their buffer serves the next read."""
        self.staging.release(rows)

    def claim(self, keys: Sequence[bytes], segments: list[ReadSegment]) -> torch.Tensor:
        """On the engine thread: move what `read` got out of the tiers' books; the rows, ``[k, block_nbytes]``."""
        parts: list[torch.Tensor] = []
        done = 0
        reason = "miss"
        for segment in segments:
            if segment.error is not None:
                self.failed(segment.level, segment.error)
                reason = "error"
                continue
            if segment.corrupt:
                reason = "corrupt"
            n = segment.rows.shape[0]
            if not n:
                continue
            self._promoted(segment.level, list(keys[done : done + n]))
            parts.append(segment.rows)
            done += n
        if done < len(keys):
            self.stats.failures[reason] += len(keys) - done
        if not parts:
            return torch.empty((0, self.pool.block_nbytes), dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else _joined(parts)

    def tick(self, now: float) -> None:
        """Advance the lower tiers' policy clocks (time-aware policies), as the device's is."""
        self.migration.tick(now)

    def _promoted(self, level: int, keys: list[bytes]) -> None:
        """`keys` now live on the device: out of the policy's view, and out of the tier unless it is shared."""
        store = self.store(level)
        self.stats.tiers[store.name].loaded_blocks += len(keys)
        for key in keys:
            self.migration.promote(key)
        if self._keeps_copies(store):
            return
        try:
            store.delete(keys)
        except TierError as err:
            self.failed(level, err)

    def usable(self, store: KVTier) -> bool:
        """False for a while after the store failed, so a dead backend costs one timeout, not one per step."""
        return time.monotonic() >= self._down_until.get(store.name, 0.0)

    def discard(self, keys: Sequence[bytes]) -> None:
        """The device registered `keys` (computed again): forget lower-tier placements so tiers stay exclusive.

        Only placements this process made are dropped, and never from a shared tier (another
        server may want the block there); a stale copy is only ever a verified duplicate.
        """
        gone: dict[int, list[bytes]] = {}  # level -> keys to delete there (one call per store)
        for key in keys:
            tier = self.migration.tier_of(key)
            if tier is None:
                continue
            self.migration.discard(key)
            level = self.level_of[tier.name]
            if not self._keeps_copies(self.store(level)):
                gone.setdefault(level, []).append(key)
        for level, dead in gone.items():
            try:
                self.store(level).delete(dead)
            except TierError as err:
                self.failed(level, err)

    def snapshots(self) -> tuple[TierSnapshot, ...]:
        """Every tier's state for stats and /metrics (a store's own `stats()` never raises). Read-only: any
        thread may call it; the background failures it shows were taken by `poll_background` on the engine's."""
        out = []
        for store in self.stores:
            own, counters = store.stats(), self.stats.tiers[store.name]
            down = not self.usable(store)
            out.append(TierSnapshot(
                name=store.name, blocks=own.blocks, bytes=own.bytes, capacity_bytes=own.capacity_bytes,
                demoted_blocks=counters.demoted_blocks, loaded_blocks=counters.loaded_blocks,
                errors=counters.errors, checksum_failures=own.checksum_failures, up=not down,
                down_reason=self._down_reason.get(store.name) if down else None,
                written_through_blocks=counters.written_through_blocks,
            ))
        return tuple(out)

    def persist(self, device_blocks: Sequence[tuple[bytes, int]], budget_s: float,
                batch: int = PERSIST_BATCH) -> tuple[int, int]:
        """A graceful shutdown: copy what the faster levels hold (`device_blocks`, the pool's cached blocks as
        (hash, block id), then the blocks of the tiers above it) into the first persistent store (the disk tier)
        and sync it, so a restart on the same store finds them; no new batch starts once `budget_s` has passed.
        Tiers are exclusive while serving; this copy duplicates, which is harmless at the end. (blocks written,
        blocks left out for lack of time); (0, 0) without a persistent store."""
        level = self.persistent_level
        if level is None or not self.usable(self.store(level)) or budget_s <= 0:
            return 0, 0
        target, deadline = self.store(level), time.monotonic() + budget_s
        # each batch: (keys, a function reading their rows, None where a block is gone)
        batches = [([k for k, _ in part], lambda part=part: list(self.pool.read_blocks([b for _, b in part])
                                                                  .view(torch.uint8).reshape(len(part), -1)))
                   for part in _batched(list(device_blocks), batch)]
        for upper in self.stores[: level - 1]:
            keys = upper.keys() if hasattr(upper, "keys") else []  # (the host tier: the levels above a disk tier)
            batches += [(part, lambda upper=upper, part=part: upper.get(part)) for part in _batched(keys, batch)]
        written = left = 0
        try:
            for n, (keys, read) in enumerate(batches):
                if time.monotonic() > deadline:
                    left = sum(len(k) for k, _ in batches[n:])
                    break
                missing = [not there for there in target.contains(keys)]
                got = [(key, row) for key, row, want in zip(keys, read(), missing) if want and row is not None]
                if got:
                    target.put([key for key, _ in got], torch.stack([row for _, row in got]))
                    written += len(got)
            target.flush(sync=True)  # (on disk, not only in the page cache: a crash after this loses nothing)
        except TierError as err:
            self.failed(level, err)
        return written, left

    def close(self) -> None:
        for store in self.stores:
            store.close()


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Row blocks as one ``[sum n, row]`` tensor: a view when they lie back to back in one buffer (as `read`
    leaves them), else a copy."""
    first, rows = parts[0], 0
    for part in parts:
        if part.data_ptr() != first.data_ptr() + rows * first.stride(0) * first.element_size():
            return torch.cat(parts)
        rows += part.shape[0]
    return torch.as_strided(first, (rows, first.shape[1]), first.stride())


def _batched(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]
