"""`MigrationPolicy`: where a block goes when a tier evicts it, and what a lower-tier hit does.

Tiers below the device are exclusive caches of whole blocks, each ordered by its own
`EvictionPolicy` through the same hooks the device index uses. A block evicted from
tier k is demoted to tier k+1 when loading it back from there beats recomputing it
(`CostBenefitModel.worth_loading`), and dropped otherwise; a tier that overflows
demotes its own victim the same way. A hit in a lower tier promotes the block: it
leaves that tier and is registered on the device again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sage_infer.kv_policy.base import EvictionPolicy
from sage_infer.kv_policy.cost_benefit import CostBenefitModel
from sage_infer.kv_policy.quota import QuotaManager


@dataclass(slots=True)
class BlockMeta:
    """What a demotion decision needs to know about a block."""

    depth: int  # position in its prefix chain, 0 = first block of a prompt
    parent: bytes | None
    tokens: int  # tokens the block holds (the last block of a prompt may be partial)
    tenant: bytes = b""  # whose block (the prefix-cache extra key, which includes the tenant salt)


def _always(_key: bytes) -> bool:
    return True


class LowerTier:
    """A dict of blocks, capped at `capacity_blocks`, ordered by `policy`.

    No prefix-tree constraint here: a lower tier stores blocks, it does not serve
    lookups on its own, so any block may be its victim.
    """

    def __init__(self, name: str, capacity_blocks: int, policy: EvictionPolicy,
                 quota: QuotaManager | None = None) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"tier {name}: capacity must be at least one block, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.blocks: dict[bytes, BlockMeta] = {}
        self.quota = quota
        if quota is not None:
            quota.add_tier(name, capacity_blocks)
        # hears ("stored" | "removed", key) as blocks enter and leave this tier (the engine's KV events)
        self.listener: Callable[[str, bytes], None] | None = None
        # blocks kept ahead of the others (a retained conversation's): the victim is one of them only when the tier
        # holds nothing else
        self.protected: Callable[[bytes], bool] | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def insert(self, key: bytes, meta: BlockMeta) -> list[tuple[bytes, BlockMeta]]:
        """Store a block; returns the blocks evicted to make room (oldest decision first)."""
        assert key not in self.blocks, "a block is in at most one tier"
        evicted = []
        quota = self.quota
        if quota is not None and len(self.blocks) < self.capacity_blocks and quota.at_max(self.name, meta.tenant):
            # a cap below the device: a tenant at its maximum makes room from its own blocks even when the tier has some
            own = self.policy.victim(lambda k: self.blocks[k].tenant == meta.tenant)
            if own is not None:
                quota.self_evictions[self.name, quota.share(meta.tenant).name] += 1
                evicted.append((own, self.pop(own)))
            else:  # nothing of its own here (its blocks are on other servers of a shared tier): it grows, counted
                quota.violations[self.name, quota.share(meta.tenant).name, "max"] += 1
        protected = self.protected
        unprotected = None if protected is None else (lambda k: not protected(k))
        while len(self.blocks) >= self.capacity_blocks:
            victim = None if unprotected is None else self._victim(meta.tenant, unprotected)
            if victim is None:
                victim = self._victim(meta.tenant, _always)
            assert victim is not None, f"tier {self.name} is full but its policy names no victim"
            evicted.append((victim, self.pop(victim)))
        self.blocks[key] = meta
        self.policy.on_insert(key, meta.depth, meta.parent)
        if quota is not None:
            quota.added(self.name, meta.tenant)
        if self.listener is not None:
            self.listener("stored", key)
        return evicted

    def _victim(self, tenant, allowed: Callable[[bytes], bool]) -> bytes | None:
        """The policy's victim among `allowed` keys (with quotas, also by the tenants' shares)."""
        if self.quota is None:
            return self.policy.victim(allowed)
        return self.quota.pick_victim(
            self.name, tenant, lambda extra: self.policy.victim(allowed if extra is None else
                                                                lambda k: allowed(k) and extra(k)),
            lambda k: self.blocks[k].tenant)

    def pop(self, key: bytes) -> BlockMeta:
        meta = self.blocks.pop(key)
        self.policy.on_remove(key)
        if self.quota is not None:
            self.quota.removed(self.name, meta.tenant)
        if self.listener is not None:
            self.listener("removed", key)
        return meta


class MigrationPolicy:
    """Demotion and promotion between the device and `tiers` (fastest first).

    Without a cost model every evicted block is demoted (nothing says loading loses).
    `listener`, when set, hears every placement a demotion makes, in decision order, as
    ``(key, from_level, to_level)`` with level 0 the device, ``i + 1`` for ``tiers[i]`` and
    ``to_level`` None when the block is dropped: what a caller moving the bytes needs.
    """

    def __init__(self, tiers: list[LowerTier], cost: CostBenefitModel | None = None) -> None:
        self.tiers = tiers
        self.cost = cost
        self.num_demoted = 0
        self.num_dropped = 0
        self.listener: Callable[[bytes, int, int | None], None] | None = None

    def tick(self, now: float) -> None:
        for tier in self.tiers:
            tier.policy.tick(now)

    def tier_of(self, key: bytes) -> LowerTier | None:
        for tier in self.tiers:
            if key in tier.blocks:
                return tier
        return None

    def promote(self, key: bytes) -> LowerTier | None:
        """A lookup reached `key`: take it out of the lower tier holding it; that tier, or None."""
        tier = self.tier_of(key)
        if tier is not None:
            tier.pop(key)
        return tier

    def put_back(self, key: bytes, meta: BlockMeta, tier: LowerTier) -> None:
        """Undo a promotion the device had no room for (a request longer than the device)."""
        level = self.tiers.index(tier)
        for victim, victim_meta in tier.insert(key, meta):
            self.demote(victim, victim_meta, level + 1)

    def discard(self, key: bytes) -> None:
        """The device computed `key` again: drop any lower-tier copy so tiers stay exclusive."""
        tier = self.tier_of(key)
        if tier is not None:
            tier.pop(key)

    def demote(self, key: bytes, meta: BlockMeta, level: int = 0) -> None:
        """`key` left tier `level` (0 = device): move it one tier down, or drop it."""
        pending = [(key, meta, level)]
        while pending:
            key, meta, level = pending.pop(0)
            if level >= len(self.tiers) or (
                self.cost is not None and not self.cost.worth_loading(self.tiers[level].name, meta.tokens, meta.depth)
            ):
                self.num_dropped += 1
                if self.listener is not None:
                    self.listener(key, level, None)
                continue
            self.num_demoted += 1
            victims = self.tiers[level].insert(key, meta)
            if self.listener is not None:
                self.listener(key, level, level + 1)
            pending.extend((victim, victim_meta, level + 1) for victim, victim_meta in victims)
