"""Batched block moves through the real host and disk tiers: runs of slots, gathers from a real KV pool, pieces
moved on the row threads (batches past `rows.PARALLEL_MIN_BYTES`), all bit-exact and checksummed."""

from __future__ import annotations

import crc32c
import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.migrator import pool_gather
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.tiers import DiskTier, HostTier, rows
from sage_infer.kv_runtime.tiers.rows import GIL_FREE_ROW_BYTES, PARALLEL_MIN_BYTES
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key
from tests.test_kv_tiers import corrupt

SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16)  # bf16: 32 KiB blocks
BPB = SCHEMA.bytes_per_block
N = PARALLEL_MIN_BYTES // BPB + 24  # one batch is large enough for the row threads


@pytest.fixture(autouse=True)
def two_move_threads():
    """Large moves split over two threads, whatever this machine's default (so the threaded path runs)."""
    before = rows.MOVE_THREADS
    rows.set_move_threads(2)
    yield
    rows.set_move_threads(before)


def chain(n: int, salt: str = "b") -> tuple[list[bytes], torch.Tensor]:
    keys = hash_token_blocks(list(range(n * 16)), 16, make_extra_key("m", "r", "bf16", cache_salt=salt))
    return keys, torch.randint(0, 256, (n, BPB), dtype=torch.uint8)


def test_the_batch_is_large_enough_to_take_the_threaded_path():
    assert rows.parallel(BPB, N * BPB) and BPB >= GIL_FREE_ROW_BYTES and N * BPB >= PARALLEL_MIN_BYTES


def test_host_batches_land_in_one_run_of_slots_and_round_trip(tmp_path):
    keys, blocks = chain(N)
    with HostTier(SCHEMA, 2 * N * BPB, background_crc=False) as tier:
        tier.put(keys, blocks)
        slots = [tier.slot_of(key) for key in keys]
        assert slots == list(range(slots[0], slots[0] + N))  # one contiguous run: one copy
        out = torch.empty_like(blocks)
        assert torch.equal(tier.get_prefix(keys, out=out), blocks)
        tier.delete(keys)
        again, more = chain(N, salt="again")
        tier.put(again, more)  # the freed slots come back as a run again
        slots = [tier.slot_of(key) for key in again]
        assert slots == list(range(slots[0], slots[0] + N))
        assert torch.equal(tier.get_prefix(again), more)


def test_host_put_gather_copies_device_blocks_from_the_pool_bit_exact():
    pool = KVPool(SCHEMA, N + 10)
    ids = torch.randperm(N + 10)[:N].tolist()  # scattered in the pool, as a request's blocks are
    _, blocks = chain(N)
    pool.write_rows(ids, blocks)
    keys, _ = chain(N, salt="pool")
    for background in (False, True):  # checksums taken as copied, and on the tier's thread
        with HostTier(SCHEMA, N * BPB, background_crc=background, background_min_bytes=0) as tier:
            tier.put_gather(keys, pool_gather(pool, ids))
            assert tier.drain(10)
            assert torch.equal(tier.get_prefix(keys), blocks)
            assert tier.stats().checksum_failures == 0


def test_a_corrupt_host_block_in_a_large_batch_cuts_the_prefix_there():
    keys, blocks = chain(N)
    with HostTier(SCHEMA, N * BPB) as tier:
        tier.put(keys, blocks)
        corrupt(tier, keys[N // 2], blocks[N // 2])
        assert torch.equal(tier.get_prefix(keys), blocks[: N // 2])
        assert tier.stats().checksum_failures == 1 and tier.contains([keys[N // 2]]) == [False]


def test_disk_batches_round_trip_through_a_restart(tmp_path):
    keys, blocks = chain(N)
    pool = KVPool(SCHEMA, N)
    pool.write_rows(list(range(N)), blocks)
    with DiskTier(SCHEMA, tmp_path, 4 * N * BPB) as tier:
        tier.put_gather(keys, pool_gather(pool, list(range(N))))
        tier.flush()
        out = torch.empty_like(blocks)
        assert torch.equal(tier.get_prefix(keys, out=out), blocks)
    with DiskTier(SCHEMA, tmp_path, 4 * N * BPB) as again:  # the checksums written with each piece hold
        assert torch.equal(again.get_prefix(keys), blocks)
        assert again.stats().checksum_failures == 0


def test_a_corrupt_disk_block_in_a_batch_is_detected_and_dropped(tmp_path):
    keys, blocks = chain(N)
    bad = N // 3
    with DiskTier(SCHEMA, tmp_path, 4 * N * BPB) as tier:
        tier.put(keys, blocks)
        corrupt(tier, keys[bad], blocks[bad])
        got = tier.get(keys)  # the whole batch: one bad block, the others verified
        assert got[bad] is None
        assert all(torch.equal(row, blocks[i]) for i, row in enumerate(got) if i != bad)
        assert tier.stats().checksum_failures == 1 and tier.contains([keys[bad]]) == [False]
        assert torch.equal(tier.get_prefix(keys), blocks[:bad])  # a chain stops where it is missing


def test_large_rows_checksummed_as_copied_keep_the_crc32c_of_the_bytes():
    rows.set_move_threads(1)  # (one thread: the single-pass kernel path where the kernel loads)
    big = KVCacheSchema(num_layers=16, num_kv_heads=4, head_dim=64, block_size=16)  # 256 KiB blocks
    keys = hash_token_blocks(list(range(3 * 16)), 16, make_extra_key("m", "r", "bf16", cache_salt="big"))
    blocks = torch.randint(0, 256, (3, big.bytes_per_block), dtype=torch.uint8)
    with HostTier(big, 4 * big.bytes_per_block, background_crc=False) as tier:
        tier.put(keys, blocks)
        stored = [int(tier._crc[tier.slot_of(key)]) for key in keys]
        assert stored == [crc32c.crc32c(row) for row in blocks.numpy()]  # the same CRC32C the disk and wire use
        assert torch.equal(tier.get_prefix(keys), blocks)
        tier.slab[tier.slot_of(keys[1]), 100] ^= 4
        assert torch.equal(tier.get_prefix(keys), blocks[:1]) and tier.stats().checksum_failures == 1
