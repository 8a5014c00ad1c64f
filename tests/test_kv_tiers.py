"""The behaviour every KV tier store promises (host DRAM, disk, Redis), run against each one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers import DiskTier, HostTier, KVTier, RedisTier
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key
from tests.redis_fixture import start_redis

SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)  # 512-byte blocks
BPB = SCHEMA.bytes_per_block
KINDS = ["host", "disk", "redis"]


@pytest.fixture(scope="module")
def redis_server():
    server = start_redis()
    yield server
    server.kill()


@pytest.fixture
def make_tier(request, tmp_path):
    """make_tier(kind, capacity_blocks) -> a fresh tier; closed at teardown."""
    made = []

    def make(kind: str, capacity_blocks: int = 64, schema: KVCacheSchema = SCHEMA):
        capacity = capacity_blocks * schema.bytes_per_block
        if kind == "host":
            tier = HostTier(schema, capacity)
        elif kind == "disk":
            tier = DiskTier(schema, tmp_path / "disk", capacity)
        else:
            server = request.getfixturevalue("redis_server")
            server.client().flushdb()
            tier = RedisTier(schema, server.url, capacity)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def chain(n: int, salt: str = "t") -> tuple[list[bytes], torch.Tensor]:
    """n chained block hashes and n random blocks."""
    tokens = list(range(n * SCHEMA.block_size))
    keys = hash_token_blocks(tokens, SCHEMA.block_size, make_extra_key("m", "r", "bf16", cache_salt=salt))
    return keys, torch.randint(0, 256, (n, BPB), dtype=torch.uint8)


def settle(tier) -> None:
    """Let the disk tier's writer catch up (other tiers store synchronously)."""
    if hasattr(tier, "flush"):
        tier.flush()


def corrupt(tier, key: bytes, payload: torch.Tensor) -> None:
    """Flip one payload bit where the tier keeps the block, through the tier's own storage."""
    if isinstance(tier, HostTier):
        assert tier.drain(10)  # after its checksum was taken (the checksum thread lags a put by a little)
        tier.slab[tier.slot_of(key), 7] ^= 1
    elif isinstance(tier, DiskTier):
        tier.flush()
        needle = payload.numpy().tobytes()
        for path in sorted(Path(tier.directory).glob("*.seg")):
            data = path.read_bytes()
            at = data.find(needle)
            if at >= 0:
                with open(path, "r+b") as f:
                    f.seek(at + 7)
                    f.write(bytes([data[at + 7] ^ 1]))
                return
        raise AssertionError("block not found in any segment")
    else:
        raw = tier.client
        value = bytearray(raw.get(tier.redis_key(key)))
        value[-1] ^= 1
        raw.set(tier.redis_key(key), bytes(value))


@pytest.mark.parametrize("kind", KINDS)
def test_a_tier_speaks_the_protocol(make_tier, kind):
    assert isinstance(make_tier(kind), KVTier)


@pytest.mark.parametrize("kind", KINDS)
def test_put_then_get_is_bit_exact(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(5)
    tier.put(keys, blocks)
    got = tier.get(keys)
    assert all(torch.equal(g, b) for g, b in zip(got, blocks))
    settle(tier)
    assert torch.equal(torch.stack(tier.get(keys)), blocks)


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_keys_are_misses(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(3)
    tier.put(keys[:2], blocks[:2])
    assert [g is not None for g in tier.get(keys)] == [True, True, False]
    stats = tier.stats()
    assert (stats.gets, stats.hits, stats.misses) == (3, 2, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_contains_and_delete(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(4)
    tier.put(keys, blocks)
    tier.delete([keys[1], keys[3]])
    assert tier.contains(keys) == [True, False, True, False]
    settle(tier)
    assert tier.contains(keys) == [True, False, True, False]
    assert tier.get([keys[1]]) == [None]


@pytest.mark.parametrize("kind", KINDS)
def test_putting_a_known_block_again_stores_it_once(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(3)
    tier.put(keys, blocks)
    tier.put(keys, blocks)
    settle(tier)
    assert tier.stats().blocks == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_tier_evicts_its_oldest_blocks_without_error(make_tier, kind):
    tier = make_tier(kind, capacity_blocks=8)
    old_keys, old = chain(8, salt="old")
    new_keys, new = chain(8, salt="new")
    tier.put(old_keys, old)
    settle(tier)
    tier.put(new_keys, new)
    settle(tier)
    stats = tier.stats()
    assert not any(tier.contains(old_keys[:4]))
    assert tier.contains([new_keys[-1]]) == [True]
    assert torch.equal(tier.get([new_keys[-1]])[0], new[-1])
    assert stats.evictions >= 4
    assert stats.bytes <= stats.capacity_bytes


@pytest.mark.parametrize("kind", KINDS)
def test_get_prefix_stops_at_the_first_hole(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(6)
    tier.put(keys[:3] + keys[4:], torch.cat([blocks[:3], blocks[4:]]))
    settle(tier)
    prefix = tier.get_prefix(keys)
    assert torch.equal(prefix, blocks[:3])
    assert tier.stats().misses == 3  # the hole and the two blocks behind it


@pytest.mark.parametrize("kind", KINDS)
def test_get_prefix_loads_into_the_callers_buffer(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(4)
    tier.put(keys, blocks)
    out = torch.zeros((6, BPB), dtype=torch.uint8)
    prefix = tier.get_prefix(keys, out=out)
    assert prefix.data_ptr() == out.data_ptr() and torch.equal(out[:4], blocks)


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_block_is_a_counted_miss_and_cuts_the_prefix(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(4)
    tier.put(keys, blocks)
    settle(tier)
    corrupt(tier, keys[1], blocks[1])
    assert torch.equal(tier.get_prefix(keys), blocks[:1])
    assert tier.stats().checksum_failures == 1
    assert tier.contains([keys[1]]) == [False]  # the bad block is gone
    assert torch.equal(tier.get([keys[2]])[0], blocks[2])


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_of_another_dtype_are_stored_as_their_bytes(make_tier, kind):
    tier = make_tier(kind)
    keys, _ = chain(2)
    values = torch.randn(2, BPB // 2, dtype=torch.float32).to(torch.bfloat16)
    tier.put(keys, values)
    assert torch.equal(tier.get_prefix(keys).view(torch.bfloat16), values)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_arguments_are_rejected(make_tier, kind):
    tier = make_tier(kind)
    keys, blocks = chain(2)
    with pytest.raises(ValueError, match="blocks must be"):
        tier.put(keys, blocks[:1])
    with pytest.raises(ValueError, match="blocks must be"):
        tier.put(keys + keys[:1], blocks)  # 3 keys, 2 blocks
    with pytest.raises(ValueError, match="32-byte hash"):
        tier.get([b"short"])


def test_no_tier_source_uses_pickle():
    package = Path(__file__).resolve().parents[1] / "sage_infer" / "kv_runtime" / "tiers"
    sources = list(package.glob("*.py"))
    assert sources and [p.name for p in sources if "pickle" in p.read_text()] == []


def test_importing_the_tiers_does_not_import_redis():
    import subprocess
    import sys

    code = "import sys, sage_infer.kv_runtime.tiers as t; t.HostTier; t.DiskTier; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "False"
