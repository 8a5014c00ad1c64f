"""Blocks that requests hold wait outside the LRU, ARC, LFU and cost policies' orders: eviction never walks past them,
and every victim is the one those policies chose when they scanned past them."""

from __future__ import annotations

import random

import pytest

from sage_infer.kv_policy import make_policy
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.prefix_reuse import PrefixReuseIndex, make_extra_key

KEY = make_extra_key("m", "r", "bf16")
BS = 4


@pytest.mark.parametrize("name", ["lru", "arc", "lfu", "cost"])
def test_held_blocks_change_no_victim(name):
    """The same random life of blocks through a policy told of holds (`on_use`) and one never told (which skips the
    held keys as not evictable, as before the hook): the same victim every time."""
    rng = random.Random(7)
    told, untold = make_policy(name), make_policy(name)
    live: set[bytes] = set()
    held: set[bytes] = set()
    victims = 0
    for step in range(20_000):
        op = rng.random()
        if op < 0.25 or not live:
            key = step.to_bytes(4, "little")
            for policy in (told, untold):
                policy.on_insert(key)
            live.add(key)
        elif op < 0.45:
            key = rng.choice(sorted(live))
            for policy in (told, untold):
                policy.on_hit(key)
        elif op < 0.65:
            key = rng.choice(sorted(live - held or live))
            if key not in held:
                held.add(key)
                told.on_use(key)
        elif op < 0.85 and held:
            key = rng.choice(sorted(held))
            held.discard(key)
            for policy in (told, untold):
                policy.on_release(key)
        else:
            barred = {k for k in live if rng.random() < 0.3} | held  # (and inner nodes of the tree, say)
            victim = told.victim(lambda k, barred=barred: k not in barred)
            assert victim == untold.victim(lambda k, barred=barred: k not in barred)
            if victim is not None:
                victims += 1
                for policy in (told, untold):
                    policy.on_remove(victim)
                live.discard(victim)
        assert len(told) == len(untold) == len(live)
    assert victims > 1000


@pytest.mark.parametrize("name", ["lru", "arc", "lfu", "cost", "s3fifo"])
def test_an_eviction_asks_about_one_block_when_running_requests_hold_the_rest(name, monkeypatch):
    index = PrefixReuseIndex(BS, make_policy(name))
    manager = BlockManager(640, BS, index)
    chains, token = [], 0
    for _ in range(10):  # ten sequences of 64 blocks, every block registered
        ids, parent = manager.allocate(64, KEY), None
        for i, block in enumerate(ids):
            ids[i], parent = manager.cache_block(block, parent, list(range(token, token + BS)), KEY)
            token += BS
        chains.append(ids)
    manager.free(list(reversed(chains[-1])))  # the newest finished: cached; the nine before it still run
    asked = []
    victim = type(index.policy).victim
    monkeypatch.setattr(type(index.policy), "victim",
                        lambda self, evictable: victim(self, lambda key: asked.append(key) or evictable(key)))
    for n in range(1, 33):
        manager.allocate(1, KEY)  # each evicts one cached block: the finished chain's leaf
        assert len(asked) == n
    manager.check_invariants()


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "lfu"])
def test_retained_blocks_wait_outside_the_queue_and_go_last_oldest_retention_first(name, monkeypatch):
    from sage_infer.kv_runtime.retention import KVRetention

    index = PrefixReuseIndex(BS, make_policy(name))
    manager = BlockManager(640, BS, index)
    manager.retention = retention = KVRetention(640)
    chains, token = [], 0
    for _ in range(10):  # ten finished sequences of 64 cached blocks
        ids, parent, hashes = manager.allocate(64, KEY), None, []
        for i, block in enumerate(ids):
            ids[i], parent = manager.cache_block(block, parent, list(range(token, token + BS)), KEY)
            hashes.append(parent)
            token += BS
        manager.free(list(reversed(ids)))
        chains.append((ids, hashes))
    for n, (_, hashes) in enumerate(chains[:9]):  # nine conversations retained, the oldest first
        assert retention.retain(f"c{n}", hashes, ttl_s=60) == 64
    asked = []
    victim = type(index.policy).victim
    monkeypatch.setattr(type(index.policy), "victim",
                        lambda self, evictable: victim(self, lambda key: asked.append(key) or evictable(key)))
    kept = set(manager.allocate(64, KEY))  # the one unretained chain goes, asking about its blocks alone
    assert kept == set(chains[9][0]) and len(asked) == 64 and retention.evicted_under_pressure == 0
    taken = manager.allocate(3, KEY)  # then retained blocks: the oldest retention's, deepest first
    assert taken == list(reversed(chains[0][0][-3:])) and retention.evicted_under_pressure == 3
    retention.release("c1")  # an ended retention's blocks are ordinary cached blocks again, evicted before retained
    before = retention.evicted_under_pressure
    assert set(manager.allocate(64, KEY)) == set(chains[1][0]) and retention.evicted_under_pressure == before
    manager.check_invariants()
