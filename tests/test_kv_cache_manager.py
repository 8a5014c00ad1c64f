"""`KVCacheManager`: match records nothing, admit is all-or-nothing, on_evict sees each eviction first."""

from __future__ import annotations

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.kv_policy import make_policy
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.prefix_reuse.index import PrefixReuseIndex

BS = 4
KEY = b"k"


def manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(BlockManager(num_blocks, BS, PrefixReuseIndex(BS, make_policy("lru"))))


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams(), KEY)


def compute(kv: KVCacheManager, tokens: list[int], seq_id: int = 0) -> Sequence:
    """Admit a prompt, 'compute' all of it, register its full blocks; the sequence still holds them."""
    seq = seq_of(tokens, seq_id)
    match = kv.match(seq)
    num_new = seq.num_tokens - match.num_tokens
    assert kv.admit(seq, match, num_new)
    seq.num_computed_tokens += num_new
    kv.commit(seq)
    return seq


class PolicySpy:
    """Counts the policy calls an admission path makes."""

    def __init__(self, policy):
        self.policy, self.hits = policy, 0

    def on_hit(self, key):
        self.hits += 1
        self.policy.on_hit(key)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def test_match_records_nothing_and_touches_no_policy():
    kv = manager()
    kv.free(compute(kv, list(range(9))))
    spy = PolicySpy(kv.index.policy)
    kv.index.policy = spy
    before = kv.index.metrics.to_dict()
    for _ in range(5):
        match = kv.match(seq_of(list(range(9)), 1))
    assert match.num_tokens == 8
    assert kv.index.metrics.to_dict() == before and spy.hits == 0


def test_admit_counts_the_query_once_and_marks_the_hit():
    kv = manager()
    kv.free(compute(kv, list(range(9))))
    seq = seq_of(list(range(9)), 1)
    assert kv.admit(seq, kv.match(seq), 1)
    assert kv.index.metrics.queries == 2 and kv.index.metrics.hit_tokens == 8
    assert seq.num_cached_tokens == 8 and seq.num_computed_tokens == 8 and len(seq.block_table) == 3


def test_a_readmitted_sequence_is_not_counted_again():
    kv = manager()
    seq = compute(kv, list(range(9)))
    kv.free(seq)  # as preemption does
    seq.num_computed_tokens = 0
    assert kv.admit(seq, kv.match(seq), 1)
    assert kv.index.metrics.queries == 1


def test_match_leaves_the_last_token_to_compute_unless_asked_not_to():
    kv = manager()
    kv.free(compute(kv, list(range(8))))
    assert kv.match(seq_of(list(range(8)), 1)).num_tokens == 4
    assert kv.match(seq_of(list(range(8)), 1), keep_last_token=False).num_tokens == 8


def test_admit_changes_nothing_when_the_pool_is_short():
    kv = manager(num_blocks=4)
    holder = compute(kv, list(range(100, 108)))  # holds 2 blocks
    kv.free(compute(kv, list(range(8)), 1))  # 2 cached blocks
    seq = seq_of(list(range(8)) + list(range(200, 209)), 2)  # hits 2 blocks, needs 3 more: only 0 free
    match = kv.match(seq)
    assert match.num_tokens == 8
    state = (kv.block_manager.ref_counts[:], kv.index.metrics.to_dict())
    assert not kv.can_admit(seq, match, seq.num_tokens - 8)
    assert not kv.admit(seq, match, seq.num_tokens - 8)
    assert (kv.block_manager.ref_counts, kv.index.metrics.to_dict()) == state
    assert seq.block_table == [] and not seq.admitted_once
    kv.block_manager.check_invariants()
    kv.free(holder)


def test_matched_cached_blocks_do_not_count_as_room_for_the_rest():
    # 3 blocks: 2 cached (the match) + 1 free. The cached ones are taken by the match itself,
    # so only the free one is left for new tokens.
    kv = manager(num_blocks=3)
    kv.free(compute(kv, list(range(8))))
    seq = seq_of(list(range(8)) + list(range(50, 58)), 1)
    match = kv.match(seq)
    assert kv.available_after(match) == 1
    assert kv.can_admit(seq, match, 4) and not kv.can_admit(seq, match, 5)


def test_on_evict_sees_an_allocations_evictions_in_one_batch_before_the_slots_are_reused():
    kv = manager(num_blocks=2)
    seen = []
    batches = []
    kv.on_evict = lambda blocks: batches.append(len(blocks)) or seen.extend(
        (block.block_id, block.block_hash, block.token_ids, block.depth) for block in blocks)
    first = compute(kv, list(range(8)))
    hashes = list(first.block_hashes)
    kv.free(first)
    other = compute(kv, list(range(40, 48)), 1)
    assert sorted(b for b, *_ in seen) == [0, 1] and batches == [2]
    assert {h for _, h, _, _ in seen} == set(hashes)
    assert {(t, d) for _, _, t, d in seen} == {(tuple(range(4)), 0), (tuple(range(4, 8)), 1)}
    assert kv.match(seq_of(list(range(9)), 2)).num_tokens == 0
    kv.free(other)


def test_reset_prefix_cache_reports_every_eviction():
    kv = manager()
    seen = []
    kv.on_evict = seen.extend
    kv.free(compute(kv, list(range(12))))
    assert kv.block_manager.reset_prefix_cache() == 3
    assert len(seen) == 3
