"""What only the disk tier promises: restarts, foreign records, compaction, a writer that never blocks put."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers import DiskTier
from sage_infer.kv_runtime.tiers.segment import HEADER
from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError
from tests.test_kv_tiers import BPB, SCHEMA, chain

RECORD = HEADER.size + BPB


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier(SCHEMA, tmp_path, 64 * BPB, segment_bytes=8 * RECORD)
    yield tier
    tier.close()


def test_a_directory_that_cannot_hold_files_is_refused_at_construction(tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    for directory in ["/proc/self", tmp_path / "a-file"]:
        with pytest.raises(TierConfigError, match="cannot hold files"):
            DiskTier(SCHEMA, directory, 64 * BPB)


def test_the_start_up_write_probe_leaves_nothing_behind(tmp_path):
    with DiskTier(SCHEMA, tmp_path / "kv", 64 * BPB):
        assert list((tmp_path / "kv").iterdir()) == []


def test_a_restarted_tier_finds_what_it_wrote(tmp_path):
    keys, blocks = chain(10)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as first:
        first.put(keys, blocks)  # close() writes what is still queued
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as second:
        assert torch.equal(second.get_prefix(keys), blocks)
        assert second.stats().blocks == 10


def test_a_deleted_block_stays_deleted_after_restart(tmp_path):
    keys, blocks = chain(3)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as first:
        first.put(keys, blocks)
        first.flush()
        first.delete([keys[1]])
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as second:
        assert second.contains(keys) == [True, False, True]


def test_records_of_another_schema_are_skipped_and_counted(tmp_path):
    other = KVCacheSchema(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4)  # same 512-byte blocks
    assert other.bytes_per_block == BPB
    keys, blocks = chain(3)
    with DiskTier(other, tmp_path, 64 * BPB) as foreign:
        foreign.put(keys, blocks)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as tier:
        assert tier.contains(keys) == [False, False, False]
        assert tier.stats().skipped_records == 3


def test_a_torn_record_at_a_segment_end_is_skipped(tmp_path):
    keys, blocks = chain(3)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as first:
        first.put(keys, blocks)
    segment = next(tmp_path.glob("*.seg"))
    data = segment.read_bytes()
    segment.write_bytes(data[: 2 * RECORD + HEADER.size + 10])  # the third write was cut short
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as tier:
        assert tier.contains(keys) == [True, True, False]
        assert tier.stats().skipped_records == 1
        assert torch.equal(tier.get_prefix(keys), blocks[:2])


def test_put_returns_before_the_disk_write_and_queued_blocks_are_readable(tier):
    keys, blocks = chain(4)
    with tier._append_lock:  # the writer thread cannot write while this is held
        done = threading.Event()
        threading.Thread(target=lambda: (tier.put(keys, blocks), done.set()), daemon=True).start()
        assert done.wait(timeout=30), "put waited for the disk"
        assert tier.stats().pending_blocks == 4
        assert torch.equal(tier.get_prefix(keys), blocks)
        assert list(tier.directory.glob("*.seg")) == []
    tier.flush()
    assert tier.stats().pending_blocks == 0
    assert torch.equal(tier.get_prefix(keys), blocks)


def test_a_full_write_queue_drops_the_batch_tail_instead_of_blocking(tmp_path):
    keys, blocks = chain(5)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB, max_pending_bytes=3 * RECORD) as tier:
        with tier._append_lock:
            tier.put(keys, blocks)
            assert tier.stats().dropped == 2
        tier.flush()
        assert tier.contains(keys) == [True, True, True, False, False]


def test_a_block_deleted_while_queued_is_not_indexed(tier):
    keys, blocks = chain(2)
    with tier._append_lock:
        tier.put(keys, blocks)
        tier.delete([keys[0]])
    tier.flush()
    assert tier.contains(keys) == [False, True]
    assert tier.stats().fragmentation > 0


def test_compaction_reclaims_dead_bytes(tier):
    keys, blocks = chain(32)
    tier.put(keys, blocks)
    tier.flush()
    tier.delete(keys[::2])
    before = tier.stats()
    assert before.fragmentation == pytest.approx(0.5)
    reclaimed = tier.compact(min_fragmentation=0.4)
    after = tier.stats()
    assert reclaimed > 0 and after.bytes == before.bytes - reclaimed
    assert after.fragmentation < 0.1
    assert torch.equal(tier.get_prefix(keys[1::2]), blocks[1::2])
    assert sum(p.stat().st_size for p in tier.directory.glob("*.seg")) == after.bytes


def test_the_cap_drops_whole_oldest_segments(tier):
    keys, blocks = chain(100)
    tier.put(keys, blocks)
    tier.flush()
    stats = tier.stats()
    assert stats.bytes <= stats.capacity_bytes
    assert tier.contains([keys[0], keys[-1]]) == [False, True]
    assert stats.blocks + stats.evictions == 100


def test_a_torn_tail_counts_as_dead_bytes_once(tmp_path):
    keys, blocks = chain(2)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as first:
        first.put(keys, blocks)
    segment = next(tmp_path.glob("*.seg"))
    segment.write_bytes(segment.read_bytes()[: RECORD + 100])
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as tier:
        assert tier.stats().fragmentation == pytest.approx(100 / (RECORD + 100))


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_reads_copy_and_verify_every_record_of_a_batch(tmp_path, monkeypatch, one_pass):
    """A batch read (runs of adjacent records, a gap, a segment boundary) returns the bytes written; a flipped
    bit anywhere in a payload, even its last byte, is caught; a record cut short by a truncated file reads as
    missing; the one-pass read (the segment mapped, copy + CRC) and the two-pass read (preadv, then CRC) agree."""
    from sage_infer.kv_runtime.tiers import disk
    from tests.test_kv_tiers import corrupt

    monkeypatch.setattr(disk, "ONE_PASS_READS", one_pass)
    keys, blocks = chain(12)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB, segment_bytes=8 * RECORD) as tier:
        tier.put(keys, blocks)
        tier.flush()
        order = [*range(6), 9, 7, 8, 10, 11]  # runs, a gap (keys[6] not asked), a segment boundary
        out = torch.zeros(len(order), BPB, dtype=torch.uint8)
        assert torch.equal(tier.get_prefix([keys[i] for i in order], out=out), blocks[order])
        corrupt(tier, keys[4], blocks[4])
        with open(tier._index[keys[9]].segment.path, "r+b") as f:  # the last byte of a payload
            f.seek(tier._index[keys[9]].offset + RECORD - 1)
            last = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([last ^ 0x80]))
        got = tier.get(keys)
        assert got[4] is None and got[9] is None and tier.stats().checksum_failures == 2
        assert all(torch.equal(row, blocks[i]) for i, row in enumerate(got) if i not in (4, 9))
        loc = tier._index[keys[11]]
        os.truncate(loc.segment.path, loc.offset + RECORD - 5)  # (a file cut under the tier: a short read)
        got = tier.get(keys[10:])
        assert torch.equal(got[0], blocks[10]) and got[1] is None


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_a_chain_written_leaf_first_reads_back_in_chain_order_in_one_read_per_segment(tmp_path, monkeypatch,
                                                                                        one_pass):
    """Demotion writes a chain leaf first; a load asks for it root first. The records are read in file order (one
    group per segment, not one per record) and each lands in the row its key asked for; a corrupt one is caught and
    the prefix stops before it."""
    from sage_infer.kv_runtime.tiers import disk, disk_read
    from tests.test_kv_tiers import corrupt

    monkeypatch.setattr(disk, "ONE_PASS_READS", one_pass)
    groups = []
    real_plan = disk_read.plan
    monkeypatch.setattr(disk_read, "plan", lambda *a: groups.append(real_plan(*a)) or groups[-1])
    keys, blocks = chain(12)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB, segment_bytes=8 * RECORD) as tier:
        tier.put(keys[::-1], blocks.flip(0))  # leaf first, as a chain is evicted
        tier.flush()
        out = torch.zeros(12, BPB, dtype=torch.uint8)
        assert torch.equal(tier.get_prefix(keys, out=out), blocks)
        assert len(groups[-1]) == 2  # the 12 records span two 8-record segments
        # (3, 1, 2, 0: adjacent records, in file order for rows 0, 2, 1, 3: out of order, first and last 3 apart)
        for shuffled in ([3, 0, 11, 7, 1], [3, 1, 2, 0]):
            got = tier.get([keys[i] for i in shuffled])
            assert all(row is not None and torch.equal(row, blocks[i]) for i, row in zip(shuffled, got))
        assert tier.stats().checksum_failures == 0
        corrupt(tier, keys[5], blocks[5])
        assert torch.equal(tier.get_prefix(keys, out=out), blocks[:5])


def test_a_written_batchs_buffer_takes_the_next_put_and_both_batches_read_back(tier):
    keys, blocks = chain(10)
    tier.put(keys[:6], blocks[:6])
    tier.flush()
    assert len(tier._spare) == 1  # (the written batch's buffer, kept for the next put)
    tier.put(keys[6:], blocks[6:])  # copied into its first rows
    assert torch.equal(tier.get_prefix(keys[6:]), blocks[6:])  # (from the buffer while it is queued)
    tier.flush()
    assert torch.equal(tier.get_prefix(keys), blocks)


def test_a_batchs_headers_filled_at_once_are_the_headers_written_one_by_one():
    import numpy as np

    from sage_infer.kv_runtime.tiers.segment import encode_header, encode_headers

    keys = [bytes([i]) * 30 + b"\0\0" for i in range(5)]  # trailing zero bytes are kept
    digest = b"d" * 15 + b"\0"
    records = torch.full((5, HEADER.size + 3), 0xAA, dtype=torch.uint8)
    encode_headers(records, digest, keys, 3, np.array([7 * i for i in range(5)], dtype=np.uint32))
    assert [bytes(r[: HEADER.size].numpy()) for r in records] == [
        encode_header(digest, key, 3, 7 * i) for i, key in enumerate(keys)]
    assert (records[:, HEADER.size :] == 0xAA).all()  # the payloads are untouched


def test_a_read_takes_queued_blocks_from_memory_and_the_rest_from_disk(tier):
    keys, blocks = chain(8)
    tier.put(keys[:4], blocks[:4])
    tier.flush()
    with tier._append_lock:  # keys 4.. stay queued
        tier.put(keys[5:], blocks[5:])
        got = tier.get(keys)
        assert [row is not None for row in got] == [True] * 4 + [False] + [True] * 3
        assert all(torch.equal(row, blocks[i]) for i, row in enumerate(got) if row is not None)
        assert torch.equal(tier.get_prefix(keys), blocks[:4])  # a chain stops at its first miss
        order = [6, 1, 7, 0]
        assert torch.equal(tier.get_prefix([keys[i] for i in order]), blocks[order])


def test_a_durable_flush_syncs_only_what_changed_since_the_last_one(tier, monkeypatch):
    from sage_infer.kv_runtime.tiers import disk

    synced: list[int] = []
    monkeypatch.setattr(disk, "_fdatasync", synced.append)
    keys, blocks = chain(12)
    tier.put(keys[:10], blocks[:10])  # 8 records a segment: two segments
    tier.flush(sync=True)
    assert sorted(synced) == sorted(seg.fd for seg in tier._segments.values()) and len(synced) == 2
    synced.clear()
    tier.flush(sync=True)
    assert synced == []  # nothing written since
    tier.put(keys[10:], blocks[10:])
    tier.flush(sync=True)
    assert synced == [tier._active.fd]
    synced.clear()
    tier.delete([keys[0]])  # a delete rewrites a record's magic: its segment is synced again
    tier.flush(sync=True)
    assert synced == [tier._index[keys[1]].segment.fd]


@pytest.mark.parametrize("kernel", [True, False], ids=["one-pass", "no-kernel"])
def test_puts_gathers_compaction_and_reads_agree_with_and_without_the_kernel(tmp_path, monkeypatch, kernel):
    """Where the one-pass kernel does not load, a put copies with numpy, the writer takes the CRCs and the header
    CRCs with `crc32c`, reads take preadv: the same records either way, verified after a restart."""
    from sage_infer.kv_runtime.migrator import rows_gather
    from sage_infer.kv_runtime.tiers import rows

    if not kernel:
        monkeypatch.setattr(rows, "_kernel", None)
    keys, blocks = chain(20)
    with DiskTier(SCHEMA, tmp_path, 64 * BPB, segment_bytes=8 * RECORD) as tier:
        tier.put(keys[:10], blocks[:10])
        tier.put_gather(keys[10:], rows_gather(list(blocks[10:])))  # a gather of separate rows
        tier.flush()
        tier.delete(keys[:8:2])
        assert tier.compact(min_fragmentation=0.4) > 0
    with DiskTier(SCHEMA, tmp_path, 64 * BPB) as again:
        kept = [i for i in range(20) if i not in (0, 2, 4, 6)]
        assert torch.equal(again.get_prefix([keys[i] for i in kept]), blocks[kept])
        assert again.stats().checksum_failures == 0


def test_a_delete_leaves_the_disk_writes_to_the_writer_thread(tier, monkeypatch):
    from sage_infer.kv_runtime.tiers.segment import Segment

    writers: list[str] = []
    mark_dead = Segment.mark_dead
    monkeypatch.setattr(Segment, "mark_dead", lambda seg, offset: (writers.append(threading.current_thread().name),
                                                                   mark_dead(seg, offset)))
    keys, blocks = chain(6)
    tier.put(keys, blocks)
    tier.flush()
    tier.delete(keys[1:4])
    assert tier.contains(keys) == [True, False, False, False, True, True]  # gone at once
    tier.flush()  # (waits for the marks too)
    assert writers == ["sage-disk-tier-writer"] * 3
    with open(tier._index[keys[0]].segment.path, "rb") as f:
        data = f.read()
    assert [data[i * RECORD : i * RECORD + 4] for i in range(6)] == [b"SKV1", b"SKV0", b"SKV0", b"SKV0", b"SKV1",
                                                                     b"SKV1"]
