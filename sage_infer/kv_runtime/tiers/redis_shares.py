"""Tenant quotas across a fleet sharing a Redis tier: each server publishes what its tenants hold there.

A tier below the device is capped per tenant (`kv_policy.quota`); a remote tier that several
servers share (the replicas of a fleet pointed at one Redis) would otherwise be capped per
server, letting a tenant hold its maximum share N times over. So each server writes, under a
key of its own that expires unless it is rewritten, how many blocks of the shared tier each
tenant holds through it, and reads the others': the quota then counts a tenant's blocks in the
whole fleet. A server that stops is out of the sum within `TTL_S`. Counts are published and
read at most every `REFRESH_S` (two pipelined round trips per refresh, only as the tier's
blocks change or a quota is asked); a Redis that
fails keeps the last counts (the quota falls back to them, then to this server's own).

Tenants are named by a short hash of their prefix-cache key, never by their salt.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable

log = logging.getLogger(__name__)

TTL_S = 30  # a server's counts outlive its last refresh this long
REFRESH_S = 0.5  # the others' counts are read at most this often


def tenant_tag(tenant: bytes) -> str:
    return hashlib.blake2b(tenant, digest_size=8).hexdigest()


class RedisTenantShares:
    """The blocks each tenant holds in a shared Redis tier through the other servers (`others`)."""

    def __init__(self, client, key_prefix: bytes, local: Callable[[], dict[bytes, int]],
                 refresh_s: float = REFRESH_S, ttl_s: int = TTL_S, clock: Callable[[], float] = time.monotonic,
                 failures: tuple[type[BaseException], ...] = (Exception,)) -> None:
        self.client, self.local, self.refresh_s, self.ttl_s, self.clock = client, local, refresh_s, ttl_s, clock
        self.server = uuid.uuid4().hex
        self.members_key = key_prefix + b"tenants"
        self.key_prefix = key_prefix + b"tenants:"
        self.counts: dict[str, int] = {}
        self.fetched: float | None = None
        self.failures = failures
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
        """Publish this server's counts, then sum the other live servers'."""
        self.fetched = self.clock()
        own_key = self.key_prefix + self.server.encode()
        own = {tenant_tag(tenant): n for tenant, n in self.local().items() if n > 0}
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(own_key)
            if own:
                pipe.hset(own_key, mapping=own)
                pipe.expire(own_key, self.ttl_s)
            pipe.sadd(self.members_key, self.server)
            pipe.smembers(self.members_key)
            members = [m.decode() if isinstance(m, bytes) else m for m in pipe.execute()[-1]]
            others = [m for m in members if m != self.server]
            pipe = self.client.pipeline(transaction=False)
            for member in others:
                pipe.hgetall(self.key_prefix + member.encode())
            tables = pipe.execute() if others else []
            gone = [m for m, table in zip(others, tables) if not table]
            if gone:  # expired (stopped) or holding nothing: out of the set until they publish again
                self.client.srem(self.members_key, *gone)
        except self.failures as err:
            self.errors += 1
            if self.errors == 1:
                log.warning("tenant shares of the shared tier: Redis failed (%s); quotas use the last counts", err)
            return
        counts: dict[str, int] = {}
        for table in tables:
            for tag, n in table.items():
                tag = tag.decode() if isinstance(tag, bytes) else tag
                counts[tag] = counts.get(tag, 0) + int(n)
        self.counts = counts

    def close(self) -> None:
        """This server leaves the sum now (not only when its key expires)."""
        try:
            self.client.delete(self.key_prefix + self.server.encode())
            self.client.srem(self.members_key, self.server)
        except self.failures:
            pass
