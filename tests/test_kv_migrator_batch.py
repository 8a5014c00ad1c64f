"""`KVMigrator.on_evict` applies a whole eviction batch store by store, on real tiers and a real KV pool: device
blocks gathered from the pool into the host tier, the host tier's victims read out in one call and moved to the
disk tier, every byte where the policy placed it, and a block its source lost is forgotten, not moved."""

from __future__ import annotations

import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_policy import make_policy
from sage_infer.kv_runtime.hierarchy import HierarchyManager
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.tiers import DiskTier, HostTier
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key
from sage_infer.prefix_reuse.index import EvictedBlock

SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BPB = SCHEMA.bytes_per_block


def setup(tmp_path, host_blocks: int = 3):
    pool = KVPool(SCHEMA, 16)
    host = HostTier(SCHEMA, host_blocks * BPB)
    disk = DiskTier(SCHEMA, tmp_path, 64 * BPB)
    hierarchy = HierarchyManager.build(pool, [host, disk], lambda capacity: make_policy("lru", capacity=capacity))
    return pool, host, disk, hierarchy


def evict(pool: KVPool, hierarchy: HierarchyManager, n: int, salt: str) -> tuple[list[bytes], torch.Tensor]:
    """Fill device blocks 0..n-1 with random bytes and evict them as one batch (one chain)."""
    keys = hash_token_blocks(list(range(n * 4)), 4, make_extra_key("m", "r", "bf16", cache_salt=salt))
    rows = torch.randint(0, 256, (n, BPB), dtype=torch.uint8)
    pool.write_rows(list(range(n)), rows)
    hierarchy.on_evict([EvictedBlock(i, key, keys[i - 1] if i else None, tuple(range(4 * i, 4 * i + 4)),
                                     b"", i + 1) for i, key in enumerate(keys)])
    return keys, rows


def test_a_batch_fills_the_host_tier_and_its_victims_move_to_disk_bit_exact(tmp_path):
    pool, host, disk, hierarchy = setup(tmp_path)
    keys, rows = evict(pool, hierarchy, 8, "a")
    disk.flush()
    on_host = [k for k in keys if host.contains([k])[0]]
    on_disk = [k for k in keys if disk.contains([k])[0]]
    assert len(on_host) == 3 and len(on_disk) == 5 and not set(on_host) & set(on_disk)  # exclusive tiers
    for i, key in enumerate(keys):
        store = host if key in on_host else disk
        assert torch.equal(store.get([key])[0], rows[i])
    assert torch.equal(hierarchy.fetch(keys), rows)  # the chain comes back whole, from both tiers
    # placed on the host and moved on within the batch: never written there
    assert hierarchy.stats.tiers["host"].demoted_blocks == 3 and hierarchy.stats.tiers["disk"].demoted_blocks == 5
    hierarchy.close()


def test_a_host_victim_that_is_corrupt_is_dropped_not_moved(tmp_path):
    pool, host, disk, hierarchy = setup(tmp_path)
    keys, _ = evict(pool, hierarchy, 3, "first")  # the host tier is full
    host.drain(10)
    for key in keys:  # every host block corrupt: whichever the next demotion displaces is read out bad
        host.slab[host.slot_of(key), 5] ^= 1
    evict(pool, hierarchy, 1, "second")  # displaces one host block: read out to move to disk
    disk.flush()
    (victim,) = [key for key in keys if not host.contains([key])[0]]
    assert host.stats().checksum_failures == 1
    assert not disk.contains([victim])[0]  # gone, not written corrupt
    assert hierarchy.migration.tier_of(victim) is None  # and out of the policy's books
    hierarchy.close()
