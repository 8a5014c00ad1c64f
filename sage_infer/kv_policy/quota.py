"""`QuotaManager`: per-tenant shares of each KV tier (device, host, disk, remote).

A tenant is what a request's ``cache_salt`` selects: its blocks are hashed under their own
extra key, so they never match another tenant's. Each configured tenant has a minimum and a
maximum share of every tier, as fractions of the tier's capacity in blocks; every other
tenant gets the default share. Shares act when a tier picks a victim:

1. a tenant over its maximum that needs room evicts its own blocks first (in the tier's
   policy order); it keeps growing only when none of its blocks can go, which is counted
   as a ``max`` violation;
2. otherwise the victim is a block of a tenant over *its* maximum, if any;
3. otherwise a block of a tenant above its minimum: a tenant at or below its minimum share
   is not evicted for someone else;
4. otherwise (every evictable block belongs to tenants at their minimum) the policy's
   victim goes anyway, counted as a ``min`` violation.

Lower tiers also hold a tenant at its maximum when the tier is not full (a cap, not only an
eviction order); the device cannot, since its blocks are in use by running requests.
`QuotaManager` only counts and orders: the prefix index (device) and `LowerTier` (below)
ask it for the order and tell it what they hold.

A remote tier several servers share (a fleet's Redis) is counted fleet-wide: with
`share_fleet_wide` a tenant's held blocks there are this server's plus what the others
report (`kv_runtime.tiers.redis_shares`), so its maximum caps it in the whole fleet (to
within one block per server: a server holding none of a tenant's blocks has none of its own
to evict for the next one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sage_infer.config.serve import QuotaConfig

DEVICE = "device"  # the tier name of the device pool (lower tiers use their `LowerTier.name`)


class FleetShares(Protocol):
    def others(self, tenant: bytes) -> int:
        """Blocks of `tenant` the other servers sharing the tier hold there."""

    def changed(self) -> None:
        """This server's own counts changed (publish them when due)."""

@dataclass(frozen=True, slots=True)
class TenantShare:
    """A tenant's share of every tier, as fractions of the tier's blocks."""

    name: str
    min_share: float = 0.0
    max_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_share <= self.max_share <= 1.0:
            raise ValueError(f"tenant {self.name!r}: need 0 <= min_share <= max_share <= 1, "
                             f"got {self.min_share} / {self.max_share}")


@dataclass(slots=True)
class TierUsage:
    capacity_blocks: int
    blocks: Counter[bytes] = field(default_factory=Counter)  # tenant key -> blocks held


class QuotaManager:
    """Shares keyed by tenant key (the prefix-cache extra key of that tenant's salt)."""

    def __init__(self, shares: dict[bytes, TenantShare], default: TenantShare | None = None) -> None:
        self.shares = dict(shares)
        self.default = default if default is not None else TenantShare("other")
        self.tiers: dict[str, TierUsage] = {}
        self.violations: Counter[tuple[str, str, str]] = Counter()  # (tier, tenant name, "min"|"max") -> events
        self.self_evictions: Counter[tuple[str, str]] = Counter()  # (tier, tenant name) -> own blocks it evicted
        # tier -> the other servers sharing it (`others(tenant)`: blocks they hold of it), for a tier a fleet shares
        self.fleet: dict[str, FleetShares] = {}
        # a block's tenant key from the key it is stored under (a model with KV groups keys a group's blocks with more)
        self.tenant_of: Callable[[bytes], bytes] = _same

    def share(self, tenant: bytes) -> TenantShare:
        return self.shares.get(self.tenant_of(tenant), self.default)

    def add_tier(self, tier: str, capacity_blocks: int) -> None:
        self.tiers[tier] = TierUsage(capacity_blocks)

    # -- bookkeeping ------------------------------------------------------------------------------

    def added(self, tier: str, tenant: bytes) -> None:
        usage = self.tiers.get(tier)
        if usage is not None:
            usage.blocks[self.tenant_of(tenant)] += 1
            if tier in self.fleet:
                self.fleet[tier].changed()

    def removed(self, tier: str, tenant: bytes) -> None:
        usage = self.tiers.get(tier)
        if usage is not None:
            tenant = self.tenant_of(tenant)
            usage.blocks[tenant] -= 1
            if usage.blocks[tenant] <= 0:
                del usage.blocks[tenant]
            if tier in self.fleet:
                self.fleet[tier].changed()

    def share_fleet_wide(self, tier: str, fleet: FleetShares) -> None:
        """`tier` is shared by several servers: shares count a tenant's blocks there through all of them."""
        self.fleet[tier] = fleet

    def local_blocks(self, tier: str) -> dict[bytes, int]:
        """Blocks per tenant this server holds in `tier`."""
        usage = self.tiers.get(tier)
        return dict(usage.blocks) if usage is not None else {}

    def held(self, tier: str, tenant: bytes) -> int:
        tenant = self.tenant_of(tenant)
        usage = self.tiers.get(tier)
        mine = usage.blocks.get(tenant, 0) if usage is not None else 0
        fleet = self.fleet.get(tier)
        return mine + fleet.others(tenant) if fleet is not None else mine

    def _limit(self, tier: str, tenant: bytes, which: str) -> float:
        share = self.share(tenant)
        return getattr(share, which) * self.tiers[tier].capacity_blocks

    def at_max(self, tier: str, tenant: bytes) -> bool:
        """Holding another block would take `tenant` past its maximum share of `tier`."""
        return tier in self.tiers and self.held(tier, tenant) + 1 > self._limit(tier, tenant, "max_share")

    def _over_max(self, tier: str, tenant: bytes) -> bool:
        return self.held(tier, tenant) > self._limit(tier, tenant, "max_share")

    def _above_min(self, tier: str, tenant: bytes) -> bool:
        return self.held(tier, tenant) - 1 >= self._limit(tier, tenant, "min_share")

    # -- victim choice ----------------------------------------------------------------------------

    def pick_victim(
        self,
        tier: str,
        incoming: bytes | None,
        victim: Callable[[Callable[[bytes], bool] | None], bytes | None],
        tenant_of: Callable[[bytes], bytes],
    ) -> bytes | None:
        """The key `tier` should evict to make room for a block of `incoming` (None: unknown tenant).

        `victim(extra)` is the tier's own policy choice among evictable keys that also pass
        `extra` (None: no extra condition); `tenant_of(key)` names a key's tenant. Follows
        the order in the module docstring and counts what it does.
        """
        if tier not in self.tiers:
            return victim(None)
        if self.tenant_of is not _same:
            keyed, tenant_of = tenant_of, lambda k: self.tenant_of(keyed(k))
            incoming = None if incoming is None else self.tenant_of(incoming)
        if incoming is not None and self.at_max(tier, incoming):
            key = victim(lambda k: tenant_of(k) == incoming)
            if key is not None:
                self.self_evictions[tier, self.share(incoming).name] += 1
                return key
            self.violations[tier, self.share(incoming).name, "max"] += 1
        key = victim(lambda k: self._over_max(tier, tenant_of(k)))
        if key is None:
            key = victim(lambda k: self._above_min(tier, tenant_of(k)))
        if key is None:
            key = victim(None)
            if key is not None:
                self.violations[tier, self.share(tenant_of(key)).name, "min"] += 1
        return key

    def snapshot(self) -> dict:
        """Blocks per tier and tenant name, violations and self-evictions (for stats and /metrics)."""
        held: Counter[tuple[str, str]] = Counter()
        for tier, usage in self.tiers.items():
            for tenant, n in usage.blocks.items():
                held[tier, self.share(tenant).name] += n
        return {"held": dict(held), "violations": dict(self.violations),
                "self_evictions": dict(self.self_evictions)}


def _same(key: bytes) -> bytes:
    return key


def build_quota(q: QuotaConfig, tenant_key: Callable[[str], bytes]) -> QuotaManager | None:
    """Tenant shares from a `quota` section (None when it lists no tenant and leaves the default whole).

    `tenant_key(salt)` is the prefix-cache extra key a request with that ``cache_salt`` gets.
    """
    default = TenantShare("other", q.default_min_share, q.default_max_share)
    if not q.tenants and default == TenantShare("other"):
        return None
    shares = {tenant_key(t.cache_salt.get_secret_value()): TenantShare(t.name, t.min_share, t.max_share)
              for t in q.tenants}
    return QuotaManager(shares, default)
