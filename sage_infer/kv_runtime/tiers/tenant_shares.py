"""Tenant quotas across a fleet sharing a remote tier: each server publishes what its tenants hold there.

A tier below the device is capped per tenant (`kv_policy.quota`); a remote tier that several
servers share (the replicas of a fleet pointed at one Redis or one Mooncake Store) would
otherwise be capped per server, letting a tenant hold its maximum share N times over. So each
server publishes, in the store itself, how many blocks of the shared tier each tenant holds
through it, and reads the others': the quota then counts a tenant's blocks in the whole fleet.
Counts are exchanged at most every `REFRESH_S`, only as the tier's blocks change or a quota is
asked; a store that fails keeps the last counts (the quota falls back to them, then to this
server's own). `RedisTenantShares` (`redis_shares`) and `MooncakeTenantShares`
(`mooncake_shares`) are the two exchanges.

Tenants are named by a short hash of their prefix-cache key, never by their salt.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TTL_S = 30  # a server that stops publishing is out of the sum this long after its last exchange
REFRESH_S = 0.5  # the others' counts are read at most this often


def tenant_tag(tenant: bytes) -> str:
    return hashlib.blake2b(tenant, digest_size=8).hexdigest()


class TenantShares:
    """The blocks each tenant holds in a shared tier through the other servers (`others`); a store's subclass
    implements `exchange` (publish this server's counts, return the others' summed) and `leave`."""

    store = "the store"  # named in the warning when an exchange fails

    def __init__(self, local: Callable[[], dict[bytes, int]], refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic,
                 failures: tuple[type[BaseException], ...] = (Exception,)) -> None:
        self.local, self.refresh_s, self.clock, self.failures = local, refresh_s, clock, failures
        self.counts: dict[str, int] = {}
        self.fetched: float | None = None
        self.errors = 0

    def others(self, tenant: bytes) -> int:
        """Blocks of `tenant` the other live servers hold in the tier (as of the last refresh)."""
        self.changed()
        return self.counts.get(tenant_tag(tenant), 0)

    def changed(self) -> None:
        """Refresh (publish this server's counts, read the others') when the last refresh is `refresh_s` old."""
        if self.fetched is None or self.clock() - self.fetched >= self.refresh_s:
            self.refresh()

    def refresh(self) -> None:
        """Publish this server's counts, then sum the other live servers'; a failed store keeps the last sum."""
        self.fetched = self.clock()
        own = {tenant_tag(tenant): n for tenant, n in self.local().items() if n > 0}
        try:
            self.counts = self.exchange(own)
        except self.failures as err:
            self.errors += 1
            if self.errors == 1:
                log.warning("tenant shares of the shared tier: %s failed (%s); quotas use the last counts",
                            self.store, err)

    def exchange(self, own: dict[str, int]) -> dict[str, int]:
        raise NotImplementedError

    def close(self) -> None:
        """This server leaves the sum now (not only when the others stop hearing from it)."""
        try:
            self.leave()
        except self.failures:
            pass

    def leave(self) -> None:
        raise NotImplementedError


def summed(tables) -> dict[str, int]:
    """Per-tenant totals of the other servers' count tables (tag -> blocks, tags and counts as str or bytes)."""
    counts: dict[str, int] = {}
    for table in tables:
        for tag, n in table.items():
            tag = tag.decode() if isinstance(tag, bytes) else tag
            counts[tag] = counts.get(tag, 0) + int(n)
    return counts
