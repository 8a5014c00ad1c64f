"""`sage`: learned hit-density eviction with ghost admission, and its LifetimePredictor."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.lifetime import LifetimePredictor
from sage_infer.kv_policy.sage import SagePolicy

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def always(_key: bytes) -> bool:
    return True


def drive(policy: SagePolicy, capacity: int, steps: int, hot: list[bytes], hot_every: int) -> set[bytes]:
    """A tiny cache: each step (one second) inserts a fresh one-hit block; every `hot_every`
    steps the hot blocks are reused (re-inserted if they were evicted)."""
    cached: set[bytes] = set()
    fresh = 10_000

    def admit(k: bytes) -> None:
        while len(cached) >= capacity:
            v = policy.victim(always)
            assert v is not None
            cached.discard(v)
            policy.on_remove(v)
        policy.on_insert(k)
        cached.add(k)
        policy.on_release(k)

    for step in range(steps):
        policy.tick(float(step))
        if step % hot_every == 0:
            for k in hot:
                if k in cached:
                    policy.on_hit(k)
                    policy.on_release(k)
                else:
                    admit(k)
        fresh += 1
        admit(key(fresh))
    return cached


def test_sage_is_registered_and_sized_by_capacity():
    policy = make_policy("sage", capacity=100)
    assert isinstance(policy, SagePolicy) and policy.name == "sage" and policy.capacity == 100


def test_one_hit_wonders_do_not_displace_reused_blocks():
    hot = [key(i) for i in range(8)]
    policy = SagePolicy(capacity=40, seed=1)
    cached = drive(policy, capacity=40, steps=3000, hot=hot, hot_every=60)
    # the hot blocks come back every 60 s while LRU would keep blocks only ~40 s
    assert set(hot) <= cached
    assert all((policy.reuse_count(k) or 0) >= 10 for k in hot)


def test_lru_would_lose_the_same_hot_blocks():  # the scenario above is a real test of admission
    from sage_infer.kv_policy.lru import LRUPolicy

    class Adapter(LRUPolicy):
        def tick(self, now: float) -> None:
            pass

    hot = [key(i) for i in range(8)]
    cached = drive(Adapter(), capacity=40, steps=3000, hot=hot, hot_every=60)  # type: ignore[arg-type]
    assert not set(hot) <= cached


def test_ghost_hit_is_admitted_as_reused():
    policy = SagePolicy(capacity=4)
    a, b = key(1), key(2)
    policy.on_insert(a)
    policy.on_release(a)
    policy.on_insert(b)
    policy.on_release(b)
    assert policy.reuse_count(a) == 0
    policy.on_remove(a)  # evicted: remembered in the ghost list
    assert policy.reuse_count(a) is None
    policy.on_insert(a)  # comes back: a reuse the eviction cut short
    assert policy.reuse_count(a) == 1
    assert policy.reuse_count(b) == 0  # a fresh block stays on probation


def test_ghost_list_is_bounded_by_capacity():
    policy = SagePolicy(capacity=8)
    for i in range(100):
        policy.on_insert(key(i))
        policy.on_release(key(i))
        policy.on_remove(key(i))
    assert len(policy._ghost) <= 8
    assert len(policy) == 0


def test_lifetime_predictor_learns_gap_statistics():
    rng = random.Random(7)
    predictor = LifetimePredictor(num_classes=2, decay=1.0)
    for _ in range(2000):  # class 0: 60 % come back after ~100 s, the rest are evicted at ~300 s
        if rng.random() < 0.6:
            predictor.record_hit(0, rng.uniform(80.0, 120.0))
        else:
            predictor.record_eviction(0, rng.uniform(280.0, 320.0))
        predictor.record_eviction(1, rng.uniform(280.0, 320.0))  # class 1: never reused
    assert predictor.reuse_probability(0) == pytest.approx(0.6, abs=0.05)
    assert predictor.reuse_probability(1) == 0.0
    assert 70.0 <= predictor.gap_quantile(0, 0.5) <= 130.0  # within the log-bucket resolution
    assert 70.0 <= predictor.mean_gap(0) <= 130.0
    predictor.refresh()
    young, late = predictor.score(0, 10.0), predictor.score(0, 200.0)
    assert young > predictor.score(1, 10.0)  # a class that returns is worth more than one that never does
    assert young > late == 0.0  # past every observed return, a block of class 0 is dead


def test_victim_honours_evictable_and_does_not_remove():
    policy = SagePolicy(capacity=10)
    keys = [key(i) for i in range(5)]
    for k in keys:
        policy.on_insert(k)
        policy.on_release(k)
    only = keys[3]
    assert policy.victim(lambda k: k == only) == only
    assert policy.victim(lambda k: False) is None
    assert len(policy) == 5
    assert SagePolicy(capacity=10).victim(always) is None


def test_victim_only_offers_leaves():
    policy = SagePolicy(capacity=10)
    root, child = key(1), key(2)
    policy.on_insert(root)
    policy.on_insert(child, depth=1, parent=root)
    policy.on_release(child)
    policy.on_release(root)
    assert policy.victim(always) == child
    policy.on_remove(child)
    assert policy.victim(always) == root


def test_sage_replay_is_deterministic_and_beats_lru_on_real_trace():
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE} (shared traces are not checked out)")
    from sage_infer.sim.replay import distinct_blocks, load_mooncake, replay

    requests = load_mooncake(TRACE)[:2000]
    capacity = max(1, distinct_blocks(requests) * 5 // 100)
    sage = replay(requests, "sage", capacity)
    lru = replay(requests, "lru", capacity)
    assert sage.hit_rate > lru.hit_rate, (sage.hit_rate, lru.hit_rate)
    assert replay(requests, "sage", capacity).block_hits == sage.block_hits
