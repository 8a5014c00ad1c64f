"""Block hashing and the prefix reuse index: find cached KV by content, never return wrong KV."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

import sage_infer.prefix_reuse.index as index_module
from sage_infer.core.kv_schema import KVDtype
from sage_infer.kv_policy import LRUPolicy
from sage_infer.prefix_reuse import (
    PrefixReuseIndex,
    PrefixReuseMetrics,
    hash_block,
    hash_token_blocks,
    make_extra_key,
)

BS = 4
KEY = make_extra_key("tiny-llama", "local", "bf16")
TOKENS = list(range(100, 112))  # three full blocks of 4


def chain(index: PrefixReuseIndex, block_ids: list[int], tokens: list[int], extra_key: bytes = KEY) -> list[bytes]:
    """Register `tokens` block by block under `block_ids`; returns the hashes."""
    hashes: list[bytes] = []
    for i, block_id in enumerate(block_ids):
        block_hash, registered = index.insert(
            block_id, hashes[-1] if hashes else None, tokens[i * BS : (i + 1) * BS], extra_key
        )
        assert registered
        hashes.append(block_hash)
    return hashes


# ---- hashing -------------------------------------------------------------------------
def test_hash_block_is_sha256_of_length_prefixed_little_endian_int64_encoding():
    tokens = [1, 2, 3, 4]
    q = struct.Struct("<q").pack
    data = b"sage-kv-block/v1" + q(-1) + q(len(KEY)) + KEY + q(4) + struct.pack("<4q", *tokens)
    assert hash_block(None, tokens, KEY) == hashlib.sha256(data).digest()
    assert len(hash_block(None, tokens, KEY)) == 32


def test_hash_of_a_fixed_block_never_changes_between_versions():
    # Other instances and tiers find blocks by these bytes: changing the encoding is a format break.
    assert KEY.hex() == "debf403c4b0f752c8c7786c19f923d0a475daaf8b0660adc4e5e74bf87d33174"
    assert hash_block(None, [1, 2, 3, 4], KEY).hex() == (
        "f3e71219397473b1957e690dc72b28247de175ab768bc19499d6a0f36e260fd6"
    )


def test_hashes_are_identical_in_other_processes_with_other_hash_seeds():
    code = (
        "from sage_infer.prefix_reuse import make_extra_key, hash_token_blocks\n"
        "key = make_extra_key('tiny-llama', 'local', 'bf16', cache_salt='tenant')\n"
        "print(','.join(h.hex() for h in hash_token_blocks(list(range(100, 112)), 4, key)))\n"
    )
    key = make_extra_key("tiny-llama", "local", "bf16", cache_salt="tenant")
    expected = ",".join(h.hex() for h in hash_token_blocks(TOKENS, BS, key))
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == expected


def test_hash_depends_on_the_parent():
    assert hash_block(None, [1, 2], KEY) != hash_block(b"\x00" * 32, [1, 2], KEY)


def test_hash_depends_on_the_extra_key():
    other_model = make_extra_key("other-model", "local", "bf16")
    other_revision = make_extra_key("tiny-llama", "v2", "bf16")
    other_dtype = make_extra_key("tiny-llama", "local", "fp16")
    other_layout = make_extra_key("tiny-llama", "local", "bf16", layout="HND")
    keys = {KEY, other_model, other_revision, other_dtype, other_layout}
    assert len(keys) == 5
    assert len({hash_block(None, [1, 2], key) for key in keys}) == 5


def test_hash_depends_on_the_cache_salt():
    salted = make_extra_key("tiny-llama", "local", "bf16", cache_salt="tenant-a")
    other = make_extra_key("tiny-llama", "local", "bf16", cache_salt="tenant-b")
    empty = make_extra_key("tiny-llama", "local", "bf16", cache_salt="")
    assert len({KEY, salted, other, empty}) == 4


def test_hash_depends_on_token_order():
    assert hash_block(None, [1, 2, 3, 4], KEY) != hash_block(None, [2, 1, 3, 4], KEY)


def test_field_boundaries_cannot_be_shifted():
    # "ab" + "c" and "a" + "bc" would collide without length prefixes
    assert make_extra_key("ab", "c", "bf16") != make_extra_key("a", "bc", "bf16")


def test_enum_kv_dtype_hashes_like_its_value():
    assert make_extra_key("tiny-llama", "local", KVDtype.BF16) == KEY


def test_tokens_outside_int64_are_rejected():
    with pytest.raises(ValueError, match="int64"):
        hash_block(None, [1 << 63], KEY)


def test_hash_token_blocks_chains_full_blocks_and_skips_the_partial_tail():
    hashes = hash_token_blocks([*TOKENS, 7, 8], BS, KEY)
    first = hash_block(None, TOKENS[:4], KEY)
    second = hash_block(first, TOKENS[4:8], KEY)
    assert len(hashes) == 3 and hashes[:2] == [first, second]


# ---- match -----------------------------------------------------------------------------
def test_match_returns_the_longest_registered_prefix():
    index = PrefixReuseIndex(BS)
    hashes = chain(index, [7, 3], TOKENS[:8])
    match = index.match(TOKENS, KEY)
    assert match.block_ids == [7, 3] and match.block_hashes == hashes and match.num_tokens == 8


def test_match_ignores_a_partial_last_block():
    index = PrefixReuseIndex(BS)
    chain(index, [0], TOKENS[:4])
    assert index.match(TOKENS[:7], KEY).block_ids == [0]
    assert index.match(TOKENS[:3], KEY).block_ids == []


def test_match_stops_at_max_blocks():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1, 2], TOKENS)
    assert index.match(TOKENS, KEY, max_blocks=2).block_ids == [0, 1]
    assert index.match(TOKENS, KEY, max_blocks=0).block_ids == []


def test_match_stops_at_the_first_divergent_block():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1, 2], TOKENS)
    diverged = TOKENS[:4] + [0, 0, 0, 0] + TOKENS[8:]
    assert index.match(diverged, KEY).block_ids == [0]


def test_match_under_another_extra_key_misses():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1], TOKENS[:8])
    salted = make_extra_key("tiny-llama", "local", "bf16", cache_salt="tenant-b")
    assert index.match(TOKENS, salted).block_ids == []


def test_match_verifies_token_ids_when_hashes_collide(monkeypatch):
    monkeypatch.setattr(index_module, "hash_block", lambda parent, tokens, key: b"\x01" * 32)
    index = PrefixReuseIndex(BS)
    index.insert(5, None, [1, 2, 3, 4], KEY)
    assert index.match([9, 9, 9, 9], KEY).block_ids == []  # same hash, other tokens: no hit
    assert index.match([1, 2, 3, 4], KEY).block_ids == [5]


def test_match_counts_queries_blocks_and_tokens():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1], TOKENS[:8])
    index.match([*TOKENS, 1], KEY)  # 3 full blocks asked, 2 hit
    index.match(TOKENS, KEY, max_blocks=1)  # 1 asked, 1 hit
    m = index.metrics
    assert (m.queries, m.query_blocks, m.hit_blocks, m.query_tokens, m.hit_tokens) == (2, 4, 3, 16, 12)
    assert m.hit_rate == pytest.approx(0.75)


def test_dry_run_match_records_nothing():
    policy = LRUPolicy()
    index = PrefixReuseIndex(BS, policy)
    hashes = chain(index, [0, 1], TOKENS[:8])
    index.match(TOKENS[:4], KEY)
    order = policy.keys()
    assert index.match(TOKENS, KEY, record=False).block_ids == [0, 1]
    assert index.metrics.queries == 1 and policy.keys() == order != hashes


def test_match_touches_blocks_deepest_first_so_parents_are_more_recent():
    policy = LRUPolicy()
    index = PrefixReuseIndex(BS, policy)
    root, mid, leaf = chain(index, [0, 1, 2], TOKENS)
    index.match(TOKENS, KEY)
    assert policy.keys() == [leaf, mid, root]


def test_metrics_reset_and_export():
    metrics = PrefixReuseMetrics()
    assert metrics.hit_rate == 0.0
    metrics.record(query_blocks=4, hit_blocks=1, block_size=16)
    assert metrics.to_dict() == {
        "queries": 1, "query_blocks": 4, "hit_blocks": 1, "query_tokens": 64, "hit_tokens": 16, "hit_rate": 0.25,
    }
    metrics.reset()
    assert metrics.to_dict()["queries"] == 0 and metrics.hit_rate == 0.0


# ---- insert ----------------------------------------------------------------------------
def test_insert_rejects_a_partial_block():
    with pytest.raises(ValueError, match="only full blocks"):
        PrefixReuseIndex(BS).insert(0, None, [1, 2, 3], KEY)


def test_insert_of_an_already_registered_hash_changes_nothing():
    index = PrefixReuseIndex(BS)
    first_hash, _ = index.insert(0, None, TOKENS[:4], KEY)
    block_hash, registered = index.insert(9, None, TOKENS[:4], KEY)
    assert (block_hash, registered) == (first_hash, False)
    assert index.block_of(first_hash) == 0 and not index.is_registered(9) and len(index) == 1


def test_insert_under_an_unregistered_parent_is_rejected():
    index = PrefixReuseIndex(BS)
    with pytest.raises(ValueError, match="not registered"):
        index.insert(1, b"\x02" * 32, TOKENS[:4], KEY)
    assert len(index) == 0


def test_a_block_cannot_be_registered_under_two_hashes():
    index = PrefixReuseIndex(BS)
    index.insert(0, None, TOKENS[:4], KEY)
    with pytest.raises(ValueError, match="already registered"):
        index.insert(0, None, TOKENS[4:8], KEY)


def test_lookup_finds_one_verified_block():
    index = PrefixReuseIndex(BS)
    hashes = chain(index, [4, 6], TOKENS[:8])
    assert index.lookup(hashes[0], TOKENS[4:8], KEY) == 6
    assert index.lookup(None, TOKENS[4:8], KEY) is None


# ---- eviction --------------------------------------------------------------------------
def test_evict_takes_leaves_before_their_older_parents():
    policy = LRUPolicy()
    index = PrefixReuseIndex(BS, policy)
    chain(index, [0, 1, 2], TOKENS)  # root 0 is the least recent
    assert [index.evict(lambda b: True) for _ in range(3)] == [2, 1, 0]
    assert len(index) == 0 and index.evict(lambda b: True) is None


def test_evict_skips_referenced_blocks():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1], TOKENS[:8])
    other, _ = index.insert(5, None, [0, 0, 0, 0], KEY)
    assert index.evict(lambda b: b != 1) == 5  # leaf 1 is referenced, root 0 is not a leaf
    assert index.evict(lambda b: b != 1) is None
    assert index.is_registered(0) and index.is_registered(1)


def test_evict_unregisters_the_block_and_frees_its_parent_to_go_next():
    index = PrefixReuseIndex(BS)
    hashes = chain(index, [0, 1], TOKENS[:8])
    assert not index.is_leaf(0)
    assert index.evict(lambda b: True) == 1
    assert index.is_leaf(0) and index.hash_of(1) is None and index.block_of(hashes[1]) is None
    index.check_invariants()


def test_remove_refuses_an_inner_block():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1], TOKENS[:8])
    with pytest.raises(ValueError, match="children"):
        index.remove(0)
    index.remove(1)
    index.remove(0)
    assert len(index) == 0


def test_check_invariants_catches_a_wrong_child_count():
    index = PrefixReuseIndex(BS)
    chain(index, [0, 1], TOKENS[:8])
    index.check_invariants()
    index._by_block[0].num_children = 0
    with pytest.raises(AssertionError, match="child count"):
        index.check_invariants()


def test_a_kept_chain_is_the_same_hashes_and_hashes_each_block_once(monkeypatch):
    from sage_infer.prefix_reuse import hashing
    from sage_infer.prefix_reuse.hashing import extend_chain

    kept: list[bytes] = []
    assert extend_chain(kept, TOKENS, BS, KEY, 2) == hash_token_blocks(TOKENS[: 2 * BS], BS, KEY)
    assert extend_chain(kept, TOKENS, BS, KEY, 3) == hash_token_blocks(TOKENS, BS, KEY)
    index = PrefixReuseIndex(BS, LRUPolicy())
    hashes = chain(index, [7, 8], TOKENS[: 2 * BS])
    expected = hash_token_blocks(TOKENS, BS, KEY)
    calls = []
    real = hashing.hash_block
    monkeypatch.setattr(hashing, "hash_block", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(index_module, "hash_block", hashing.hash_block)
    fresh: list[bytes] = []
    for _ in range(3):  # a waiting request matched every step
        match = index.match(TOKENS, KEY, record=False, chain=fresh)
        assert (match.block_ids, match.block_hashes) == ([7, 8], hashes)
    assert len(calls) == 3  # three blocks, hashed once (the third, a miss, is hashed for its registration)
    assert fresh == expected
    assert index.match(TOKENS, KEY, record=False).block_hashes == hashes  # without a chain: hashed again
    assert len(calls) == 6
    block_hash, registered = index.insert(9, hashes[-1], TOKENS[2 * BS :], KEY, fresh[2])
    assert registered and block_hash == fresh[2] and len(calls) == 6
