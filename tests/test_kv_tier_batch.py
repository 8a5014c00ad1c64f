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


def test_a_gather_from_the_pool_checksums_each_block_as_it_copies_it():
    """`ChunkGather.gather_crc`: a pool's scattered blocks land in rows of any stride (a record's payload after its
    header), with each block's CRC32C put together from its chunks' — the `crc32c` package's value of the bytes."""
    if rows.fused_kernel() is None:
        pytest.skip("the one-pass copy + CRC kernel does not load here (a plain gather then crc32c runs instead)")
    pool = KVPool(SCHEMA, 40)
    ids = torch.randperm(40)[:24].tolist()
    _, blocks = chain(24)
    pool.write_rows(ids, blocks)
    gather = pool_gather(pool, ids)
    assert isinstance(gather, rows.ChunkGather)
    records = torch.zeros(24, 72 + BPB, dtype=torch.uint8)
    crcs = gather.gather_crc(range(24), records[:, 72:])
    assert torch.equal(records[:, 72:], blocks) and not records[:, :72].any()
    assert crcs.tolist() == [crc32c.crc32c(row.numpy()) for row in blocks]
    picked = [5, 0, 17]  # some rows of the batch, in any order
    crcs = gather.gather_crc(picked, records[:3, 72:])
    assert torch.equal(records[:3, 72:], blocks[picked])
    assert crcs.tolist() == [crc32c.crc32c(blocks[i].numpy()) for i in picked]


@pytest.mark.parametrize("threads", [2, 3])
def test_a_large_gather_split_over_threads_lands_each_block_with_its_crc(threads):
    """A demotion's gather of >= 4 MiB splits its chunks over threads (`ChunkGather.threads`; the engine thread
    waits for it): the same rows, each block's CRC32C, into rows with a header between them."""
    if rows.fused_kernel() is None:
        pytest.skip("the one-pass copy + CRC kernel does not load here (a plain gather then crc32c runs instead)")
    big = KVCacheSchema(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16)  # 128 KiB blocks
    n, bpb = 48, big.bytes_per_block  # 6 MiB
    pool = KVPool(big, 64)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:n].tolist()
    blocks = torch.randint(0, 256, (n, bpb), dtype=torch.uint8)
    pool.write_rows(ids, blocks)
    gather = pool_gather(pool, ids)
    gather.threads = threads
    records = torch.zeros(n, 72 + bpb, dtype=torch.uint8)
    crcs = gather.gather_crc(range(n), records[:, 72:])
    assert torch.equal(records[:, 72:], blocks) and not records[:, :72].any()
    assert crcs.tolist() == [crc32c.crc32c(row.numpy()) for row in blocks]


def test_the_crc32c_of_pieces_put_end_to_end_is_the_crc32c_of_the_whole():
    from sage_infer.kv_runtime.tiers.crc_concat import concat_crcs

    generator = torch.Generator().manual_seed(0)
    for rows_, pieces, size in [(3, 1, 5), (4, 2, 8), (5, 3, 7), (2, 5, 1), (3, 6, 3), (2, 7, 11), (2, 64, 4096)]:
        data = torch.randint(0, 256, (rows_, pieces, size), dtype=torch.uint8, generator=generator).numpy()
        parts = [[crc32c.crc32c(data[i, j]) for j in range(pieces)] for i in range(rows_)]
        assert concat_crcs(parts, size).tolist() == [crc32c.crc32c(data[i].tobytes()) for i in range(rows_)]


def test_disk_put_gather_from_the_pool_writes_the_checksums_a_restart_verifies(tmp_path):
    pool = KVPool(SCHEMA, 40)
    ids = torch.randperm(40)[:24].tolist()
    keys, blocks = chain(24, salt="gathered")
    pool.write_rows(ids, blocks)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB, segment_bytes=10 * (72 + BPB)) as tier:  # 3 segments
        tier.put_gather(keys, pool_gather(pool, ids))
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as again:
        assert torch.equal(again.get_prefix(keys), blocks)
        assert again.stats().checksum_failures == 0 and again.stats().blocks == 24
