"""`RedisTier`: KV blocks in a Redis server, shared by every server that uses the same schema.

Keys: ``<prefix><schema digest hex>:<block hash hex>``, so two servers running the same
model (same schema, same hashing) pointed at one Redis reuse each other's blocks, and two
schemas never collide. Value: a 12-byte header then the payload:

    offset size field
    0      4    magic b"SKR1"
    4      4    payload CRC32C (little-endian)
    8      4    payload length
    12     n    the block's bytes

Capacity: a sorted set ``<prefix><digest>:lru`` scores each block by its last access time
(put or hit), shared by all servers of that schema; a put that takes it past
``capacity_bytes // bytes_per_block`` blocks deletes the lowest-scored ones (LRU). Within
a batch, later keys score as older, so a chain loses its tail first. An optional TTL also
bounds lifetime.

Every call is one pipelined round trip (two when it evicts or finds a corrupt block; a read of more than 8 MiB
goes as one round trip per 8 MiB).
Failures: a refused connection, a timeout (short by default: `socket_timeout=0.5` s) or any
Redis error raises `TierError` at once, without retries, and is counted in `stats().errors`;
the caller recomputes. `stats()` itself never raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.errors import NotAvailableError
from sage_infer.kv_runtime.tiers.base import VALUE_HEADER, KVTier, value_header, verify_value
from sage_infer.kv_runtime.tiers.redis_shares import RedisTenantShares
from sage_infer.kv_runtime.tiers.redis_url import RedisAddress, parse_redis_url
from sage_infer.kv_runtime.tiers.tier_errors import TierError

VALUE_MAGIC = b"SKR1"
GET_CHUNK_BYTES = 8 << 20  # the most one MGET reads (see `_load`)


class RedisTier(KVTier):
    """The remote tier: a bounded, checksummed block store in Redis."""

    shared = True

    def __init__(
        self,
        schema: KVCacheSchema,
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int = 1 << 30,
        *,
        ttl_s: int | None = None,
        socket_timeout: float = 0.5,
        connect_timeout: float = 0.5,
        prefix: str = "sage:kv:",
        name: str = "redis",
    ) -> None:
        super().__init__(schema, capacity_bytes, name)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise NotAvailableError(
                "the redis tier needs the redis package: pip install 'sage-infer[redis]'"
            ) from None
        self.address: RedisAddress = parse_redis_url(url)
        self.ttl_s = ttl_s
        self.max_blocks = self.capacity_bytes // self.bytes_per_block
        self.key_prefix = f"{prefix}{self.digest.hex()}:".encode()
        self.lru_key = self.key_prefix + b"lru"
        self._failures = (redis.RedisError, OSError)
        self.shares: RedisTenantShares | None = None  # tenant quotas counted across the servers sharing it
        # no retries: a dead store must cost one timeout, then the caller recomputes
        self.client = redis.Redis(
            **self.address.connection_kwargs(),
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def tenant_shares(self, local: Callable[[], dict[bytes, int]]) -> RedisTenantShares:
        """The other servers' tenant counts in this shared tier, this server's (`local`) published for them."""
        self.shares = RedisTenantShares(self.client, self.key_prefix, local, failures=self._failures)
        return self.shares

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block hash."""
        return self.key_prefix + key.hex().encode()

    def _call(self, what: str, fn):
        try:
            return fn()
        except self._failures as err:
            with self._lock:
                self._stats.errors += 1
            raise TierError(f"{self.name} tier at {self.address}: {what} failed: {err}") from None

    def _scores(self, keys: list[bytes]) -> dict[bytes, float]:
        now = time.time()
        return {key: now - i * 1e-6 for i, key in enumerate(keys)}  # the batch's head is the newest

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """SET every block (refreshing TTL and LRU score) in one pipeline; evicts LRU blocks past the cap."""
        keys, blocks = self._check_put(keys, blocks)
        with self._lock:
            self._stats.puts += len(keys)
        if not keys:
            return
        unique, rows = self._batch_head(keys, self.max_blocks)
        data = blocks.cpu().numpy()
        values = {}
        for key in unique:
            payload = data[rows[key]]
            values[self.redis_key(key)] = b"".join((value_header(VALUE_MAGIC, payload), payload.data))

        def write() -> int:
            pipe = self.client.pipeline(transaction=False)
            if self.ttl_s:
                for rkey, value in values.items():
                    pipe.set(rkey, value, ex=self.ttl_s)
            else:
                pipe.mset(values)
            pipe.zadd(self.lru_key, self._scores(unique))
            pipe.zcard(self.lru_key)
            return pipe.execute()[-1]

        count = self._call("put", write)
        with self._lock:
            self._stats.dropped += len(set(keys)) - len(unique)
        if count > self.max_blocks:
            self._evict(count - self.max_blocks)

    def _evict(self, n: int) -> None:
        def evict() -> int:
            victims = [member for member, _ in self.client.zpopmin(self.lru_key, n)]
            if victims:
                self.client.delete(*[self.redis_key(member) for member in victims])
            return len(victims)

        evicted = self._call("evict", evict)
        with self._lock:
            self._stats.evictions += evicted

    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]:
        def read() -> list:
            # an MGET's reply is built whole before it is sent: one of hundreds of MiB (a 32K-token prompt) leaves
            # the socket silent past the timeout on a busy machine, so a long read goes as several MGETs of at most
            # GET_CHUNK_BYTES, each its own round trip (a prefix read stops at the first chunk with a gap)
            step = max(1, GET_CHUNK_BYTES // self.bytes_per_block)
            scores = self._scores(keys)  # (taken once: the chain's head stays the newest across the chunks)
            values: list = []
            for start in range(0, len(keys), step):
                part = keys[start : start + step]
                pipe = self.client.pipeline(transaction=False)
                pipe.mget([self.redis_key(key) for key in part])
                pipe.zadd(self.lru_key, {key: scores[key] for key in part}, xx=True)  # touch: only keys still there
                got = pipe.execute()[0]
                values += got
                if prefix and None in got:
                    break
            return values

        values = self._call("get", read)
        out_np = out.numpy()
        found = [False] * len(keys)
        bad, gone = [], []
        for row, value in enumerate(values):
            if value is not None and verify_value(value, VALUE_MAGIC, self.bytes_per_block):
                out_np[row] = np.frombuffer(value, dtype=np.uint8, offset=VALUE_HEADER.size)
                found[row] = True
                continue
            (bad if value is not None else gone).append(keys[row])
            if prefix:
                break
        if bad:
            with self._lock:
                self._stats.checksum_failures += len(bad)
            self.delete(bad)
        if gone:  # scored in the LRU set but its value is gone (a TTL, Redis' own eviction, a restart without it):
            # drop the score too, so the set (what `stats().blocks` counts) does not outlive the blocks
            self._call("forget", lambda: self.client.zrem(self.lru_key, *gone))
        return found

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = self._check_keys(keys)

        def exists() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            return pipe.execute()

        return [bool(n) for n in self._call("contains", exists)] if keys else []

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = self._check_keys(keys)
        if not keys:
            return

        def delete() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(*[self.redis_key(key) for key in keys])
            pipe.zrem(self.lru_key, *keys)
            pipe.execute()

        self._call("delete", delete)

    def _refresh_stats(self) -> None:
        """Blocks of this schema in the store (all servers together): the LRU set's members, which reads that
        find a value gone take out again; left as last seen if unreachable."""
        try:
            blocks = self.client.zcard(self.lru_key)
        except self._failures:
            self._stats.errors += 1
            return
        self._stats.blocks = blocks
        self._stats.bytes = blocks * self.bytes_per_block

    def close(self) -> None:
        if self.shares is not None:
            self.shares.close()
        self.client.close()
