"""Eviction policies order cached blocks; LRU evicts the least recently used evictable key."""

from __future__ import annotations

import pytest

from sage_infer.kv_policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy, register_policy

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def always(_key: bytes) -> bool:
    return True


def lru_with(*keys: bytes) -> LRUPolicy:
    policy = LRUPolicy()
    for key in keys:
        policy.on_insert(key)
    return policy


def test_make_policy_builds_a_fresh_lru_by_name():
    first, second = make_policy("lru"), make_policy("lru")
    assert isinstance(first, LRUPolicy) and first.name == "lru"
    assert first is not second


def test_unknown_policy_name_error_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown eviction policy 'belady'.*known: .*lru"):
        make_policy("belady")


def test_registering_a_name_twice_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_policy("lru")(LRUPolicy)


def test_registered_custom_policy_is_constructible_by_name():
    @register_policy("test-fifo")
    class FIFOPolicy(LRUPolicy):
        def on_hit(self, key: bytes) -> None:  # hits do not reorder a FIFO
            pass

    try:
        policy = make_policy("test-fifo")
        assert isinstance(policy, FIFOPolicy) and policy.name == "test-fifo"
    finally:
        POLICIES.pop("test-fifo")


def test_lru_victim_is_the_least_recently_inserted_key():
    assert lru_with(A, B, C).victim(always) == A


def test_lru_hit_makes_a_key_most_recent():
    policy = lru_with(A, B, C)
    policy.on_hit(A)
    assert policy.keys() == [B, C, A]
    assert policy.victim(always) == B


def test_lru_release_makes_a_key_most_recent():
    policy = lru_with(A, B, C)
    policy.on_release(B)
    assert policy.keys() == [A, C, B]


def test_lru_victim_skips_keys_that_are_not_evictable():
    policy = lru_with(A, B, C)
    assert policy.victim(lambda key: key != A) == B
    assert policy.victim(lambda key: key == C) == C


def test_lru_victim_is_none_when_nothing_is_evictable():
    assert lru_with(A, B).victim(lambda key: False) is None
    assert LRUPolicy().victim(always) is None


def test_lru_victim_does_not_remove_the_key():
    policy = lru_with(A, B)
    policy.victim(always)
    assert len(policy) == 2


def test_lru_remove_forgets_the_key():
    policy = lru_with(A, B)
    policy.on_remove(A)
    assert policy.keys() == [B] and policy.victim(always) == B


def test_eviction_policy_cannot_be_instantiated_without_hooks():
    with pytest.raises(TypeError):
        EvictionPolicy()  # type: ignore[abstract]
