"""Tenant shares of a Redis tier that several servers share (`tenant_shares`): counts in Redis hashes.

Each server writes its tenants' block counts under a key of its own that expires `TTL_S` after
its last write, and names itself in a set of members; a refresh is two pipelined round trips.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from sage_infer.kv_runtime.tiers.tenant_shares import REFRESH_S, TTL_S, TenantShares, summed


class RedisTenantShares(TenantShares):
    """The blocks each tenant holds in a shared Redis tier through the other servers (`others`)."""

    store = "Redis"

    def __init__(self, client, key_prefix: bytes, local: Callable[[], dict[bytes, int]],
                 refresh_s: float = REFRESH_S, ttl_s: int = TTL_S, clock: Callable[[], float] = time.monotonic,
                 failures: tuple[type[BaseException], ...] = (Exception,)) -> None:
        super().__init__(local, refresh_s, clock, failures)
        self.client, self.ttl_s = client, ttl_s
        self.server = uuid.uuid4().hex
        self.members_key = key_prefix + b"tenants"
        self.key_prefix = key_prefix + b"tenants:"

    def exchange(self, own: dict[str, int]) -> dict[str, int]:
        own_key = self.key_prefix + self.server.encode()
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
        return summed(tables)

    def leave(self) -> None:
        self.client.delete(self.key_prefix + self.server.encode())
        self.client.srem(self.members_key, self.server)
