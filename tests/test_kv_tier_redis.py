"""What only the remote tier promises: sharing between servers, schema isolation, failing fast."""

from __future__ import annotations

import sys

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.errors import NotAvailableError
from sage_infer.kv_runtime.tiers import RedisTier, TierConfigError, TierError
from sage_infer.kv_runtime.tiers.redis_url import parse_redis_url
from tests.redis_fixture import free_port, start_redis
from tests.test_kv_tiers import BPB, SCHEMA, chain


@pytest.fixture
def server():
    server = start_redis()
    yield server
    server.kill()


def test_two_servers_share_blocks_through_one_redis(server):
    keys, blocks = chain(4)
    with RedisTier(SCHEMA, server.url, 64 * BPB) as a, RedisTier(SCHEMA, server.url, 64 * BPB) as b:
        a.put(keys, blocks)
        assert torch.equal(b.get_prefix(keys), blocks)


def test_a_long_read_goes_in_chunks_and_a_prefix_read_stops_at_the_chunk_with_a_gap(server, monkeypatch):
    monkeypatch.setattr("sage_infer.kv_runtime.tiers.redis.GET_CHUNK_BYTES", 2 * BPB)  # two blocks an MGET
    keys, blocks = chain(7)
    with RedisTier(SCHEMA, server.url, 64 * BPB) as tier:
        tier.put(keys, blocks)
        assert torch.equal(tier.get_prefix(keys), blocks)  # four round trips, one tensor
        scores = [server.client().zscore(tier.lru_key, key) for key in keys]
        assert scores == sorted(scores, reverse=True)  # the chain's head is still the newest
        tier.delete([keys[3]])
        assert torch.equal(tier.get_prefix(keys), blocks[:3])
        assert [row is not None for row in tier.get(keys)] == [True] * 3 + [False] + [True] * 3


def test_different_schemas_never_see_each_others_blocks(server):
    other = KVCacheSchema(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4)  # same block size
    keys, blocks = chain(2)
    with RedisTier(SCHEMA, server.url, 64 * BPB) as a, RedisTier(other, server.url, 64 * BPB) as b:
        a.put(keys, blocks)
        assert b.contains(keys) == [False, False]
        assert a.redis_key(keys[0]) != b.redis_key(keys[0])


def test_blocks_expire_after_the_ttl(server):
    keys, blocks = chain(1)
    with RedisTier(SCHEMA, server.url, 64 * BPB, ttl_s=300) as tier:
        tier.put(keys, blocks)
        assert 0 < server.client().ttl(tier.redis_key(keys[0])) <= 300


def test_a_killed_server_makes_calls_raise_tier_error_and_count_it(server):
    keys, blocks = chain(2)
    with RedisTier(SCHEMA, server.url, 64 * BPB, socket_timeout=0.5) as tier:
        tier.put(keys, blocks)
        server.kill()
        with pytest.raises(TierError, match="unreachable|failed"):
            tier.get_prefix(keys)
        with pytest.raises(TierError):
            tier.put(keys, blocks)
        with pytest.raises(TierError):
            tier.contains(keys)
        assert tier.stats().errors >= 3  # stats() itself never raises


def test_nothing_listening_raises_tier_error():
    pytest.importorskip("redis", reason="the redis package is not installed (pip install 'sage-infer[redis]')")
    keys, _ = chain(1)
    with RedisTier(SCHEMA, f"redis://127.0.0.1:{free_port()}/0", 64 * BPB, connect_timeout=0.5) as tier:
        with pytest.raises(TierError, match="127.0.0.1"):
            tier.get(keys)


def test_a_missing_redis_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(NotAvailableError, match=r"pip install 'sage-infer\[redis\]'"):
        RedisTier(SCHEMA, "redis://127.0.0.1:1/0", 64 * BPB)


@pytest.mark.parametrize(
    ("url", "kwargs"),
    [
        ("redis://localhost", {"host": "localhost", "port": 6379, "db": 0, "ssl": False}),
        ("redis://10.0.0.5:7000/3", {"host": "10.0.0.5", "port": 7000, "db": 3, "ssl": False}),
        ("rediss://u:p%40ss@cache:6380/1", {"host": "cache", "port": 6380, "db": 1, "ssl": True, "password": "p@ss"}),
        ("unix:///run/redis.sock?db=2", {"unix_socket_path": "/run/redis.sock", "db": 2}),
    ],
)
def test_redis_urls_are_parsed(url, kwargs):
    got = parse_redis_url(url).connection_kwargs()
    assert {k: got[k] for k in kwargs} == kwargs


@pytest.mark.parametrize("url", ["http://x", "redis://:6379", "redis://host:99999", "redis://host/db1", "unix://"])
def test_bad_redis_urls_name_the_problem(url):
    with pytest.raises(TierConfigError, match="redis URL"):
        parse_redis_url(url)


def test_an_address_never_shows_its_password():
    assert "secret" not in str(parse_redis_url("redis://user:secret@host:1/0"))


def test_values_redis_lost_on_its_own_leave_the_block_count_when_read(server):
    """Redis drops values by itself (its maxmemory eviction, a TTL, a restart from an older snapshot) while
    their LRU scores stay: a read that finds a value gone drops the score, so `stats().blocks` (what
    `sage:kv_tier_blocks` reports) follows what the store really holds."""
    keys, blocks = chain(4)
    with RedisTier(SCHEMA, server.url, 64 * BPB) as tier:
        tier.put(keys, blocks)
        assert tier.stats().blocks == 4
        client = server.client()
        client.delete(*[tier.redis_key(key) for key in keys[2:]])  # as Redis' own eviction would
        assert tier.stats().blocks == 4  # not yet seen
        assert tier.get_prefix(keys).shape[0] == 2
        assert tier.stats().blocks == 3  # the first missing block was read: its score is gone
        assert tier.get(keys[3:]) == [None]
        assert tier.stats().blocks == 2
        assert tier.stats().errors == 0
