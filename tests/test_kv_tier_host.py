"""What only the host tier promises: one shared slab, LRU that keeps a chain's head."""

from __future__ import annotations

import torch

from sage_infer.kv_runtime.tiers import HostTier
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
