"""What only the host tier promises: one shared slab, LRU that keeps a chain's head."""

from __future__ import annotations

import torch

from sage_infer.kv_runtime.tiers import HostTier, rows
from tests.test_kv_tiers import BPB, SCHEMA, chain


def test_blocks_live_in_one_shared_arena_slab():
    keys, blocks = chain(3)
    with HostTier(SCHEMA, 8 * BPB) as tier:
        tier.put(keys, blocks)
        assert tier.slab.shape == (8, BPB)
        assert tier.arena.offset_of(tier.slab) == 0
        assert torch.equal(tier.slab[tier.slot_of(keys[2])], blocks[2])


def test_a_chain_loses_its_tail_before_its_head():
    keys, blocks = chain(4)
    other_keys, other = chain(2, salt="other")
    with HostTier(SCHEMA, 4 * BPB) as tier:
        tier.put(keys, blocks)
        tier.put(other_keys, other)
        assert tier.contains(keys) == [True, True, False, False]
        assert torch.equal(tier.get_prefix(keys), blocks[:2])


def test_a_hit_makes_a_block_recent():
    keys, blocks = chain(2, salt="a")
    more_keys, more = chain(1, salt="b")
    with HostTier(SCHEMA, 2 * BPB) as tier:
        tier.put(keys[:1], blocks[:1])
        tier.put(keys[1:], blocks[1:])
        tier.get(keys[:1])  # now keys[1] is the least recently used
        tier.put(more_keys, more)
        assert tier.contains(keys) == [True, False]


def test_a_batch_bigger_than_the_tier_keeps_its_head():
    keys, blocks = chain(6)
    with HostTier(SCHEMA, 4 * BPB) as tier:
        tier.put(keys, blocks)
        assert torch.equal(tier.get_prefix(keys), blocks[:4])
        assert tier.stats().dropped == 2


def test_got_blocks_are_copies_that_outlive_the_slab_slot():
    keys, blocks = chain(1)
    with HostTier(SCHEMA, 1 * BPB) as tier:
        tier.put(keys, blocks)
        got = tier.get(keys)[0]
        tier.put(*chain(1, salt="next"))  # reuses the only slot
        assert torch.equal(got, blocks[0])


def test_no_pinning_without_cuda():
    with HostTier(SCHEMA, BPB) as tier:
        assert tier.pinned is torch.cuda.is_available()


def test_a_pinned_slab_is_unpinned_before_it_is_unmapped(monkeypatch):
    """CUDA keeps a registration past the munmap, and a later mapping at those addresses fails: close unregisters
    first (on a GPU, tests/test_kv_tiers_cuda.py runs a second engine after a closed one)."""
    from sage_infer.kv_runtime.tiers import host as host_module

    calls = []  # (the address unpinned, whether the slab's mapping was still open then)
    monkeypatch.setattr(host_module, "unpin_host_memory",
                        lambda tensor: calls.append((tensor.data_ptr(), tier.arena.fd >= 0)))
    tier = HostTier(SCHEMA, BPB)
    address, tier.pinned = tier.slab.data_ptr(), True  # as cudaHostRegister leaves it on a GPU machine
    tier.close()
    assert calls == [(address, True)] and not tier.pinned and tier.arena.fd == -1


def test_checksums_are_taken_off_the_putting_thread_and_then_verified(monkeypatch):
    monkeypatch.setattr(rows, "_kernel", None)  # (where the one-pass kernel loads, a put checksums as it copies)
    keys, blocks = chain(4)
    with HostTier(SCHEMA, 8 * BPB, background_min_bytes=0) as tier:  # every put hands its checksums over
        tier.put(keys, blocks)
        assert tier.drain(10)
        assert not tier._pending
        tier.slab[tier.slot_of(keys[1]), 3] ^= 0x10  # corrupted after its checksum was taken
        assert torch.equal(tier.get_prefix(keys), blocks[:1])
        assert tier.stats().checksum_failures == 1


def test_a_block_read_before_its_checksum_is_taken_comes_back_whole(monkeypatch):
    monkeypatch.setattr(rows, "_kernel", None)  # (where the one-pass kernel loads, a put checksums as it copies)
    keys, blocks = chain(3)
    with HostTier(SCHEMA, 8 * BPB, background_min_bytes=0) as tier:
        with tier._lock:  # hold the checksum thread off: every slot is still pending when read
            tier.put(keys, blocks)
            assert len(tier._pending) == 3
            assert torch.equal(tier.get_prefix(keys), blocks)
            assert not tier._pending  # the read took the checksums
        tier.slab[tier.slot_of(keys[2]), 0] ^= 1  # and later reads verify against them
        assert torch.equal(tier.get_prefix(keys), blocks[:2])


def test_a_slot_rewritten_while_its_checksum_is_pending_gets_the_new_blocks_checksum():
    keys, blocks = chain(1)
    next_keys, next_blocks = chain(1, salt="next")
    with HostTier(SCHEMA, 1 * BPB, background_min_bytes=0) as tier:
        tier.put(keys, blocks)
        tier.put(next_keys, next_blocks)  # the only slot again, maybe before the first checksum
        assert tier.drain(10)
        assert torch.equal(tier.get_prefix(next_keys), next_blocks)
        assert tier.stats().checksum_failures == 0


def test_checksums_in_put_without_the_background_thread():
    keys, blocks = chain(2)
    with HostTier(SCHEMA, 4 * BPB, background_crc=False) as tier:
        tier.put(keys, blocks)
        assert not tier._pending and tier.drain(0)
        tier.slab[tier.slot_of(keys[0]), 0] ^= 1
        assert tier.get_prefix(keys).shape[0] == 0 and tier.stats().checksum_failures == 1


def test_a_small_put_checksums_as_it_copies():
    keys, blocks = chain(2)
    with HostTier(SCHEMA, 4 * BPB) as tier:  # 2 small blocks: under the 4 MiB hand-over size
        tier.put(keys, blocks)
        assert not tier._pending  # checksummed already, in the put
        tier.slab[tier.slot_of(keys[1]), 0] ^= 1
        assert torch.equal(tier.get_prefix(keys), blocks[:1]) and tier.stats().checksum_failures == 1
