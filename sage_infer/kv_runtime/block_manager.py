"""`BlockManager`: ref-counted blocks of one KV pool, with prefix caching on top.

A block is *free* (on the free list), *in use* (ref count > 0) or *cached* (ref 0,
registered in the prefix index, evictable). Freed blocks that hold a registered full
block stay cached; `allocate` takes free blocks first and evicts cached leaves only when
the free list runs short.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sage_infer.kv_policy.quota import DEVICE, QuotaManager
from sage_infer.kv_runtime.retention import KVRetention
from sage_infer.prefix_reuse.index import EvictedBlock, PrefixReuseIndex


class BlockState(str, enum.Enum):
    FREE = "free"
    IN_USE = "in_use"
    CACHED = "cached"


@dataclass(slots=True)
class BlockInfo:
    block_id: int
    ref_count: int
    state: BlockState
    block_hash: bytes | None
    num_tokens: int


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than free plus evictable cached blocks; nothing was changed."""


class BlockManager:
    """Ref-counted blocks of one KVPool. A block is free, in use (ref > 0) or cached (ref 0, registered, evictable).

    `index` None turns prefix caching off: freed blocks always go back on the free list.
    A given index is bound to this manager: it learns from `acquire`/`free` which
    registered blocks are in use, so `num_available_blocks` is exact. Register blocks
    while they are in use (`cache_block`); evict only through `allocate` or
    `reset_prefix_cache`.

    `on_evict`, when set, sees the cached blocks one `allocate` (or `reset_prefix_cache`) evicts,
    as one list in eviction order, before their slots are handed out again: the hook a lower
    tier uses to demote them (in one batch) instead of dropping them.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        index: PrefixReuseIndex | None = None,
        on_evict: Callable[[list[EvictedBlock]], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        if index is not None and index.block_size != block_size:
            raise ValueError(f"prefix index block_size {index.block_size} != block manager's {block_size}")
        self.index = index
        self.ref_counts: list[int] = [0] * num_blocks
        self.num_tokens: list[int] = [0] * num_blocks  # filled slots of each block
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self._num_in_use = 0
        self._num_filled_in_use = 0  # sum of num_tokens over in-use blocks
        self.on_evict = on_evict
        if index is not None:
            index.bind_in_use(self._is_in_use)
        self._owner: list[bytes | None] = [None] * num_blocks  # tenant of each block, counted with quotas
        self._retention: KVRetention | None = None

    @property
    def retention(self) -> KVRetention | None:
        """Cached blocks evicted only when nothing else is left. Those no request holds wait outside the eviction
        policy's queue (`on_use` .. `on_release`, as held blocks do), so an eviction never walks past them; when
        only retained blocks are left, the oldest retention's deepest cached leaf goes first."""
        return self._retention

    @retention.setter
    def retention(self, retention: KVRetention | None) -> None:
        self._retention = retention
        if retention is not None:
            retention.on_change = self._retention_changed

    def _retention_changed(self, hashes: list[bytes], retained: bool) -> None:
        index = self.index
        if index is None:
            return
        for block_hash in hashes:
            block_id = index.block_of(block_hash)
            if block_id is not None and self.ref_counts[block_id] == 0:  # (a held block: its release decides)
                (index.policy.on_use if retained else index.policy.on_release)(block_hash)

    @property
    def quota(self) -> QuotaManager | None:
        """Tenant shares of the device, from the prefix index (quotas order its evictions)."""
        return self.index.quota if self.index is not None else None

    def own(self, block_id: int, tenant: bytes | None) -> None:
        """Count `block_id` (just allocated) toward `tenant`'s share of the device, with quotas."""
        quota = self.quota
        if quota is not None and tenant is not None:
            self._owner[block_id] = tenant
            quota.added(DEVICE, tenant)

    def _disown(self, block_id: int) -> None:
        tenant = self._owner[block_id]
        if tenant is not None:
            self._owner[block_id] = None
            self.quota.removed(DEVICE, tenant)

    def _is_in_use(self, block_id: int) -> bool:
        return self.ref_counts[block_id] > 0

    def _is_unreferenced(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (hold nothing worth keeping)."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self._num_in_use

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref count 0 that stay registered in the prefix index."""
        return self.num_blocks - self.num_free_blocks - self._num_in_use

    @property
    def num_available_blocks(self) -> int:
        """What `allocate` can hand out: free blocks plus cached blocks eviction can reach.

        A cached block with an in-use block below it in the prefix tree is not counted
        until that block is released.
        """
        return self.num_free_blocks + self.num_evictable_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that eviction can reach (none without a prefix index)."""
        return self.index.num_evictable if self.index is not None else 0

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available_blocks

    def allocate(self, n: int, tenant: bytes | None = None) -> list[int]:
        """`n` blocks with ref 1 and no tokens: free blocks first (in free-list order), then evicted cached leaves.

        `tenant` (a request's extra key) is whose request needs the room: with tenant quotas
        it decides whose cached blocks go first.

        Raises `NoFreeBlocksError`, changing nothing, when `n > num_available_blocks`.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available_blocks:
            raise NoFreeBlocksError(
                f"need {n} KV blocks, only {self.num_available_blocks} available "
                f"({self.num_free_blocks} free, {self.num_evictable_blocks} evictable cached)"
            )
        counting = self.quota is not None  # (looked up once: this is every step's allocation path)
        block_ids: list[int] = []
        while len(block_ids) < n and self.free_block_ids:
            block_ids.append(self.free_block_ids.popleft())
        if counting:
            for block_id in block_ids:
                self.own(block_id, tenant)
        evicted: list[EvictedBlock] = []
        while len(block_ids) < n:  # each taken block counts for `tenant` before the next victim is chosen
            evicted.append(self._evict_one(tenant))
            block_ids.append(evicted[-1].block_id)
            if counting:
                self._disown(block_ids[-1])
                self.own(block_ids[-1], tenant)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        self._num_in_use += n
        return block_ids

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to each block (a prefix hit takes a cached block back in use).

        Pass a match's blocks in chain order (root first).
        """
        index = self.index
        for block_id in block_ids:
            if self.ref_counts[block_id]:
                self.ref_counts[block_id] += 1
                continue
            assert index is not None and index.is_registered(block_id), f"acquire of block {block_id}, which is free"
            self.ref_counts[block_id] = 1
            self.num_tokens[block_id] = self.block_size  # registered blocks are full
            self._num_filled_in_use += self.block_size
            self._num_in_use += 1
            index.set_in_use(block_id, True)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, in the given order.

        At ref 0 a registered block becomes cached, any other goes back on the free list.
        Pass a sequence's blocks in reverse so children are released before parents
        (the policy then sees parents as more recent).
        """
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"free of block {block_id}, whose ref count is already 0"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id]:
                continue
            self._num_in_use -= 1
            self._num_filled_in_use -= self.num_tokens[block_id]
            if self.index is not None and self.index.is_registered(block_id):
                self.index.set_in_use(block_id, False)
                retention = self._retention
                if retention is not None and retention.num_blocks:
                    block_hash = self.index.hash_of(block_id)
                    if retention.holds(block_hash):
                        self.index.policy.on_use(block_hash)  # retained: back out of the policy's queue
            else:
                self.num_tokens[block_id] = 0
                self.free_block_ids.append(block_id)
                self._disown(block_id)

    def unallocate(self, block_ids: Sequence[int]) -> None:
        """Free blocks `allocate` just handed out from the free list, held by no one else and never registered,
        back to the head of the free list in their order: as if they had never been taken (a start-up probe)."""
        self.free(list(reversed(block_ids)))
        for block_id in block_ids:
            assert self.free_block_ids.pop() == block_id, "unallocate of a block that was shared or registered"
        self.free_block_ids.extendleft(reversed(block_ids))

    def cache_block(
        self, block_id: int, parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes,
        block_hash: bytes | None = None,
    ) -> tuple[int, bytes]:
        """Register an in-use full block for reuse; returns `(block_id to keep, block hash)`.

        When the same KV is already registered under another block (two requests
        computed the same prefix at once), this reference moves to that block and the
        caller's copy is freed: the caller must put the returned id in its block table.
        Holding the registered block keeps the chain alive, so the next block's
        `parent_hash` can never be an evicted (orphan) parent. `block_hash`: its hash when the caller has it.
        """
        if self.index is None:
            raise RuntimeError("cache_block needs a prefix index; this block manager has prefix caching off")
        assert self.ref_counts[block_id] > 0, f"cache_block on block {block_id}, which is not in use"
        block_hash, registered = self.index.insert(block_id, parent_hash, token_ids, extra_key, block_hash)
        if registered:
            return block_id, block_hash
        existing = self.index.lookup(parent_hash, token_ids, extra_key)
        if existing is None or existing == block_id:
            return block_id, block_hash  # already ours, or a hash collision: keep our own copy
        self.acquire([existing])
        self.free([block_id])
        return existing, block_hash

    def set_num_tokens(self, block_id: int, n: int) -> None:
        """Record that `n` slots of an in-use block are filled (drives `get_fragmentation`)."""
        if not 0 <= n <= self.block_size:
            raise ValueError(f"num_tokens must be in [0, {self.block_size}], got {n}")
        assert self.ref_counts[block_id] > 0, f"set_num_tokens on block {block_id}, which is not in use"
        self._num_filled_in_use += n - self.num_tokens[block_id]
        self.num_tokens[block_id] = n

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block onto the free list; returns how many."""
        evicted: list[EvictedBlock] = []
        while self.num_evictable_blocks:
            evicted.append(self._evict_one())
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for block in evicted:
            self._disown(block.block_id)
        self.free_block_ids.extend(block.block_id for block in evicted)
        return len(evicted)

    def _evict_one(self, tenant: bytes | None = None) -> EvictedBlock:
        """Unregister the policy's victim; its KV stays in the slot until the caller reuses it."""
        assert self.index is not None, "num_available_blocks counted evictable blocks without an index"
        retention = self._retention
        evicted = None
        if retention is not None and retention.num_blocks:
            retention.expire()
            hash_of = self.index.hash_of
            evicted = self.index.evict_block(
                lambda b: self.ref_counts[b] == 0 and not retention.holds(hash_of(b)), tenant)
            if evicted is None:  # only retained blocks are left: the pool is never starved for them
                victim = self._retained_victim(retention)
                if victim is not None:
                    retention.evicted_under_pressure += 1
                    evicted = self.index.evict_leaf(victim)
        if evicted is None:
            evicted = self.index.evict_block(self._is_unreferenced, tenant)
        assert evicted is not None, "num_evictable_blocks promised an evictable block"
        self.num_tokens[evicted.block_id] = 0
        return evicted

    def _retained_victim(self, retention: KVRetention) -> int | None:
        """The oldest retention's deepest block that eviction can take (a cached leaf), else the next one's."""
        index, refs = self.index, self.ref_counts
        for chain in retention.chains():
            for block_hash in reversed(chain):
                block_id = index.block_of(block_hash)
                if block_id is not None and refs[block_id] == 0 and index.is_leaf(block_id):
                    return block_id
        return None

    def get_utilization(self) -> float:
        """Blocks in use / num_blocks."""
        return self._num_in_use / self.num_blocks

    def get_fragmentation(self) -> float:
        """Internal fragmentation: 1 - filled slots / (in-use blocks * block_size); 0.0 if none in use."""
        if not self._num_in_use:
            return 0.0
        return 1.0 - self._num_filled_in_use / (self._num_in_use * self.block_size)

    def get_block_info(self, block_id: int) -> BlockInfo:
        ref = self.ref_counts[block_id]
        block_hash = self.index.hash_of(block_id) if self.index is not None else None
        if ref > 0:
            state = BlockState.IN_USE
        elif block_hash is not None:
            state = BlockState.CACHED
        else:
            state = BlockState.FREE
        return BlockInfo(block_id, ref, state, block_hash, self.num_tokens[block_id])

    def check_invariants(self) -> None:
        """Assert every block is in exactly one of free / in use / cached, and the index is consistent."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "free list holds a block twice"
        in_use = filled = 0
        for block_id, ref in enumerate(self.ref_counts):
            assert ref >= 0, f"block {block_id} has ref count {ref}"
            registered = self._is_registered(block_id)
            if ref > 0:
                assert block_id not in free, f"in-use block {block_id} is on the free list"
                in_use += 1
                filled += self.num_tokens[block_id]
            elif block_id in free:
                assert not registered, f"free block {block_id} is registered in the prefix index"
                assert self.num_tokens[block_id] == 0, f"free block {block_id} has tokens"
            else:
                assert registered, f"block {block_id} is neither free, in use nor cached (leaked)"
        assert in_use == self._num_in_use, "in-use count is wrong"
        assert filled == self._num_filled_in_use, "filled-slot count is wrong"
        assert all(0 <= b < self.num_blocks for b in free), "free list holds an unknown block id"
        if self.index is not None:
            self.index.check_invariants()
        if self.quota is not None and DEVICE in self.quota.tiers:
            owned = Counter(t for b, t in enumerate(self._owner) if t is not None and b not in free)
            assert all(self._owner[b] is None for b in free), "a free block still counts for a tenant"
            assert owned == +self.quota.tiers[DEVICE].blocks, "tenant block counts are wrong"

    def _is_registered(self, block_id: int) -> bool:
        return self.index is not None and self.index.is_registered(block_id)

    def stats(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "num_evictable_blocks": self.num_evictable_blocks,
            "num_available_blocks": self.num_available_blocks,
            "utilization": self.get_utilization(),
            "fragmentation": self.get_fragmentation(),
            "prefix_reuse": self.index.metrics.to_dict() if self.index is not None else None,
        }
