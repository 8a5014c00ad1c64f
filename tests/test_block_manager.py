"""The block manager: ref-counted blocks, cached prefixes reused and evicted leaf-first, exact free counts."""

from __future__ import annotations

import random

import pytest

from sage_infer.kv_runtime import BlockManager, BlockState, NoFreeBlocksError
from sage_infer.prefix_reuse import PrefixReuseIndex, make_extra_key

BS = 4
KEY = make_extra_key("tiny-llama", "local", "bf16")
PROMPT = list(range(100, 112))  # three full blocks


def manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BS, PrefixReuseIndex(BS))


def admit(bm: BlockManager, tokens: list[int], extra_key: bytes = KEY) -> list[int]:
    """What the engine does for a new prompt: reuse the cached prefix, allocate the rest, register full blocks."""
    assert bm.index is not None
    match = bm.index.match(tokens, extra_key)
    bm.acquire(match.block_ids)
    table = match.block_ids + bm.allocate(-(-len(tokens) // BS) - len(match.block_ids))
    parent = match.block_hashes[-1] if match.block_hashes else None
    for i in range(len(match.block_ids), len(tokens) // BS):
        table[i], parent = bm.cache_block(table[i], parent, tokens[i * BS : (i + 1) * BS], extra_key)
    return table


def snapshot(bm: BlockManager) -> tuple:
    assert bm.index is not None
    return list(bm.ref_counts), list(bm.free_block_ids), bm.stats(), [bm.index.hash_of(b) for b in range(bm.num_blocks)]


def test_allocate_hands_out_lowest_ids_first_with_one_reference():
    bm = manager()
    assert bm.allocate(3) == [0, 1, 2]
    info = bm.get_block_info(1)
    assert (info.ref_count, info.state, info.num_tokens, info.block_hash) == (1, BlockState.IN_USE, 0, None)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3


def test_freed_unregistered_blocks_go_to_the_back_of_the_free_list():
    bm = manager()
    bm.allocate(3)
    bm.free([1])
    assert bm.get_block_info(1).state is BlockState.FREE
    assert bm.allocate(5) == [3, 4, 5, 6, 7]
    assert bm.allocate(1) == [1]


def test_acquire_adds_a_reference_and_each_free_drops_one():
    bm = manager()
    [block] = bm.allocate(1)
    bm.acquire([block])
    assert bm.ref_counts[block] == 2
    bm.free([block])
    assert bm.get_block_info(block).state is BlockState.IN_USE
    bm.free([block])
    assert bm.get_block_info(block).state is BlockState.FREE and bm.num_free_blocks == 8


def test_freeing_a_block_twice_is_an_internal_error():
    bm = manager()
    [block] = bm.allocate(1)
    bm.free([block])
    with pytest.raises(AssertionError, match="already 0"):
        bm.free([block])


def test_released_registered_blocks_stay_cached():
    bm = manager()
    table = admit(bm, PROMPT[:8] + [1])  # two full blocks and a partial one
    bm.free(list(reversed(table)))
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6 and bm.num_available_blocks == 8
    info = bm.get_block_info(table[0])
    assert info.state is BlockState.CACHED and info.block_hash is not None and info.ref_count == 0
    bm.check_invariants()


def test_allocation_uses_free_blocks_before_evicting_cached_ones():
    bm = manager()
    bm.free(list(reversed(admit(bm, PROMPT[:8]))))
    assert bm.allocate(6) == [2, 3, 4, 5, 6, 7]
    assert bm.num_cached_blocks == 2 and bm.index is not None and len(bm.index) == 2


def test_allocation_evicts_cached_leaves_when_the_free_list_runs_short():
    bm = manager()
    root, leaf = admit(bm, PROMPT[:8])
    bm.free([leaf, root])
    bm.allocate(6)
    assert bm.allocate(1) == [leaf]  # the leaf goes first, though its parent is older
    assert bm.get_block_info(root).state is BlockState.CACHED
    assert bm.allocate(1) == [root]
    assert bm.num_cached_blocks == 0 and bm.num_available_blocks == 0
    bm.check_invariants()


def test_no_free_blocks_error_changes_nothing():
    bm = manager()
    table = admit(bm, PROMPT)
    bm.free(list(reversed(table[1:])))  # two cached, one in use, five free
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="need 8 KV blocks, only 7 available"):
        bm.allocate(8)
    assert snapshot(bm) == before
    assert not bm.can_allocate(8) and bm.can_allocate(7)


def test_a_match_takes_cached_blocks_back_in_use():
    bm = manager()
    first = admit(bm, PROMPT)
    bm.free(list(reversed(first)))
    second = admit(bm, PROMPT[:8] + [7, 7, 7, 7])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert bm.ref_counts[first[0]] == 1 and bm.num_cached_blocks == 1
    assert bm.index is not None and bm.index.metrics.hit_tokens == 8
    bm.check_invariants()


def test_release_recency_decides_which_cached_prompt_is_evicted_first():
    bm = manager(4)
    [early] = admit(bm, PROMPT[:4])
    [late] = admit(bm, PROMPT[4:8])
    bm.free([late])
    bm.free([early])  # released last: most recently used
    bm.allocate(2)
    assert bm.allocate(1) == [late]


def test_utilization_and_fragmentation_count_filled_slots():
    bm = BlockManager(10, BS)
    assert bm.get_utilization() == 0.0 and bm.get_fragmentation() == 0.0
    blocks = bm.allocate(4)
    for block, filled in zip(blocks, [4, 4, 4, 1]):
        bm.set_num_tokens(block, filled)
    assert bm.get_utilization() == pytest.approx(0.4)
    assert bm.get_fragmentation() == pytest.approx(1 - 13 / 16)
    bm.free([blocks[3]])
    assert bm.get_fragmentation() == 0.0


def test_set_num_tokens_rejects_more_than_a_block():
    bm = manager()
    [block] = bm.allocate(1)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.set_num_tokens(block, BS + 1)


def test_different_cache_salts_never_share_blocks():
    bm = BlockManager(16, BS, PrefixReuseIndex(BS))
    tenant_a = make_extra_key("tiny-llama", "local", "bf16", cache_salt="a")
    tenant_b = make_extra_key("tiny-llama", "local", "bf16", cache_salt="b")
    first = admit(bm, PROMPT, tenant_a)
    bm.free(list(reversed(first)))
    second = admit(bm, PROMPT, tenant_b)
    assert set(first).isdisjoint(second)
    assert bm.index is not None and bm.index.metrics.hit_blocks == 0


def test_cache_block_moves_a_duplicate_onto_the_registered_block():
    bm = manager()
    [mine], [theirs] = bm.allocate(1), bm.allocate(1)  # two requests computed the same block at once
    assert bm.cache_block(mine, None, PROMPT[:4], KEY)[0] == mine
    kept, _ = bm.cache_block(theirs, None, PROMPT[:4], KEY)
    assert kept == mine and bm.ref_counts[mine] == 2
    assert bm.get_block_info(theirs).state is BlockState.FREE
    bm.check_invariants()


def test_cached_parent_above_an_in_use_block_is_not_counted_available():
    bm = manager()
    assert bm.index is not None
    [a_root], [b_root], [b_child] = bm.allocate(1), bm.allocate(1), bm.allocate(1)
    root_hash, _ = bm.index.insert(a_root, None, PROMPT[:4], KEY)
    assert bm.index.insert(b_root, None, PROMPT[:4], KEY) == (root_hash, False)
    bm.index.insert(b_child, root_hash, PROMPT[4:8], KEY)  # B's child hangs under A's root
    bm.free([a_root])
    assert bm.num_cached_blocks == 1 and bm.num_available_blocks == 5  # a_root cannot be evicted yet
    assert bm.allocate(5) and not bm.can_allocate(1)
    bm.free([b_child, b_root])
    assert bm.num_available_blocks == 3  # b_root free, b_child and a_root evictable
    assert bm.allocate(3)
    bm.check_invariants()


def test_reset_prefix_cache_frees_every_unreferenced_cached_block():
    bm = manager()
    held = admit(bm, PROMPT[:4])
    bm.free(list(reversed(admit(bm, PROMPT))))
    assert bm.reset_prefix_cache() == 2  # the shared root is still held
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8 - len(held)
    bm.check_invariants()


def test_without_an_index_freed_blocks_are_never_cached():
    bm = BlockManager(4, BS)
    assert bm.index is None
    bm.free(bm.allocate(4))
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 0 and bm.stats()["prefix_reuse"] is None
    with pytest.raises(RuntimeError, match="prefix caching off"):
        bm.cache_block(bm.allocate(1)[0], None, PROMPT[:4], KEY)


def test_an_index_with_another_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, BS, PrefixReuseIndex(2 * BS))


def test_check_invariants_catches_a_leaked_block():
    bm = manager()
    bm.free_block_ids.pop()
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants()


def test_random_workload_keeps_invariants_and_never_serves_wrong_kv():
    rng = random.Random(20240531)
    bm = BlockManager(40, BS, PrefixReuseIndex(BS))
    assert bm.index is not None
    keys = [KEY, make_extra_key("tiny-llama", "local", "bf16", cache_salt="tenant-b")]
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 14))] for _ in range(5)]
    content: dict[int, tuple] = {}  # what each block's KV was computed from: (extra key, tokens)
    running: list[dict] = []  # {"tokens", "key", "table", "hashes"}
    history: list[tuple[list[int], bytes]] = []
    hits = 0

    def register_full_blocks(seq: dict) -> None:
        for i in range(len(seq["hashes"]), len(seq["tokens"]) // BS):
            block = seq["table"][i]
            tokens = seq["tokens"][i * BS : (i + 1) * BS]
            content[block] = (seq["key"], tuple(tokens))
            parent = seq["hashes"][-1] if seq["hashes"] else None
            seq["table"][i], block_hash = bm.cache_block(block, parent, tokens, seq["key"])
            assert content.get(seq["table"][i]) == content[block]
            seq["hashes"].append(block_hash)
        if len(seq["tokens"]) % BS:
            bm.set_num_tokens(seq["table"][-1], len(seq["tokens"]) % BS)

    for _ in range(3000):
        op = rng.random()
        if op < 0.4:  # admit one request, or two identical ones in the same step (both miss, both compute)
            if history and rng.random() < 0.3:
                tokens, key = rng.choice(history)
            else:
                tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
                key = rng.choice(keys)
                history.append((tokens, key))
            admitted = []
            for _ in range(rng.choice((1, 1, 2))):
                match = bm.index.match(tokens, key, max_blocks=(len(tokens) - 1) // BS)
                for i, block in enumerate(match.block_ids):
                    assert content[block] == (key, tuple(tokens[i * BS : (i + 1) * BS])), "served wrong KV"
                hits += len(match.block_ids)
                bm.acquire(match.block_ids)
                needed = -(-len(tokens) // BS) - len(match.block_ids)
                if not bm.can_allocate(needed):
                    before = snapshot(bm)
                    with pytest.raises(NoFreeBlocksError):
                        bm.allocate(needed)
                    assert snapshot(bm) == before
                    bm.free(list(reversed(match.block_ids)))
                    continue
                table = match.block_ids + bm.allocate(needed)
                admitted.append({"tokens": list(tokens), "key": key, "table": table, "hashes": match.block_hashes})
            for seq in admitted:
                register_full_blocks(seq)
                running.append(seq)
        elif op < 0.75 and running:  # decode a few tokens
            seq = rng.choice(running)
            grow = rng.randrange(1, 6)
            needed = -(-(len(seq["tokens"]) + grow) // BS) - len(seq["table"])
            if bm.can_allocate(needed):
                seq["table"] += bm.allocate(needed)
                seq["tokens"] += [rng.randrange(6) for _ in range(grow)]
                register_full_blocks(seq)
        elif running:  # finish or preempt
            seq = running.pop(rng.randrange(len(running)))
            bm.free(list(reversed(seq["table"])))
        bm.check_invariants()
        refs = [0] * bm.num_blocks
        for seq in running:
            for block in seq["table"]:
                refs[block] += 1
        assert refs == bm.ref_counts
    assert hits > 100 and bm.index.metrics.hit_tokens == hits * BS
