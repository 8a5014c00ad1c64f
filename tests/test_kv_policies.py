"""LFU, ARC, S3-FIFO, cost (PGDSF) and Belady's OPT: hand-made sequences with known answers,
plus the contract every policy keeps with the prefix index and the block manager."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

import sage_infer.sim.replay as replay_module
from sage_infer.kv_policy import (
    ARCPolicy,
    CostModel,
    CostPolicy,
    EvictionPolicy,
    FutureIndex,
    LFUPolicy,
    OPTPolicy,
    S3FIFOPolicy,
    make_policy,
)
from sage_infer.kv_policy.opt import NEVER
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.prefix_reuse import PrefixReuseIndex
from sage_infer.sim.opt import future_of, replay_opt
from sage_infer.sim.replay import TraceRequest, ideal_hit_rate, replay

ONLINE = ("lru", "lfu", "arc", "s3fifo", "cost")


def k(name: object) -> bytes:
    return str(name).encode().ljust(32, b".")


def always(_key: bytes) -> bool:
    return True


def run_flat(
    policy: EvictionPolicy, names: list[object], capacity: int, cached: set[bytes] | None = None
) -> tuple[int, set[bytes]]:
    """A cache of independent one-block keys: hit, or evict the victim when full and insert.

    Pass the `cached` set of an earlier call to go on with the same cache."""
    cached = set() if cached is None else cached
    hits = 0
    for name in names:
        key = k(name)
        if key in cached:
            hits += 1
            policy.on_hit(key)
        else:
            if len(cached) == capacity:
                victim = policy.victim(always)
                assert victim in cached
                policy.on_remove(victim)
                cached.discard(victim)
            policy.on_insert(key)
            cached.add(key)
        policy.on_release(key)
    return hits, cached


def requests_of(chains: list[list[int]]) -> list[TraceRequest]:
    return [TraceRequest(i, 512 * len(ids), 1, ids) for i, ids in enumerate(chains)]


def synthetic_trace(n: int = 150, seed: int = 0, max_len: int = 30) -> list[TraceRequest]:
    """Conversations over a shared system prompt: each turn extends the conversation's last prompt."""
    rng = random.Random(seed)
    next_id, conversations, chains = 3, [], []
    for _ in range(n):
        if conversations and rng.random() < 0.6:
            conv = rng.choice(conversations)
        else:
            conv = [0, 1, 2][: rng.randint(0, 3)]
            conversations.append(conv)
        grow = rng.randint(1, 8)
        conv.extend(range(next_id, next_id + grow))
        next_id += grow
        chains.append(list(conv[:max_len]))
    return requests_of(chains)


def build(name: str, capacity: int, requests: list[TraceRequest] | None = None) -> EvictionPolicy:
    if name == "opt":
        return OPTPolicy(future_of(requests) if requests else FutureIndex({}))
    return make_policy(name, capacity=capacity)


# ---- LFU ------------------------------------------------------------------------------
def test_lfu_evicts_the_least_frequent_then_the_least_recent():
    policy = LFUPolicy()
    for key in (k("a"), k("b"), k("c")):
        policy.on_insert(key)
    policy.on_hit(k("a"))
    policy.on_hit(k("a"))
    policy.on_hit(k("c"))
    assert [policy.frequency(x) for x in (k("a"), k("b"), k("c"))] == [3, 1, 2]
    assert policy.victim(always) == k("b")
    policy.on_remove(k("b"))
    assert policy.victim(always) == k("c")
    policy.on_insert(k("d"))
    policy.on_insert(k("e"))
    assert policy.victim(always) == k("d")  # equal counts: least recent first
    policy.on_release(k("d"))
    assert policy.victim(always) == k("e")
    assert policy.victim(lambda key: key not in (k("e"), k("d"))) == k("c")


# ---- ARC ------------------------------------------------------------------------------
def test_arc_scan_does_not_flush_frequently_used_blocks_but_lru_loses_them():
    hot = ["a", "b", "a", "b"]
    scan = [f"scan{i}" for i in range(20)]
    arc = ARCPolicy(capacity=4)
    _, cached = run_flat(arc, hot + scan, capacity=4)
    assert {k("a"), k("b")} <= cached
    t1, t2, _, _ = arc.lists()
    assert t2 == [k("a"), k("b")] and len(t1) == 2
    _, cached = run_flat(make_policy("lru"), hot + scan, capacity=4)
    assert not {k("a"), k("b")} & cached


def test_arc_ghost_hit_in_b1_grows_p_and_lands_in_t2_and_b2_hit_shrinks_it():
    a, b, c, d = k("a"), k("b"), k("c"), k("d")
    arc = ARCPolicy(capacity=2)
    _, cached = run_flat(arc, ["a", "b", "b", "c"], capacity=2)  # |T1| = 1 > p = 0: a leaves T1 for B1
    assert arc.lists() == ([c], [b], [a], []) and arc.p == 0
    run_flat(arc, ["a"], 2, cached)  # c goes to B1, then a's ghost hit: p += max(|B2| / |B1|, 1)
    assert arc.p == 1 and arc.lists() == ([], [b, a], [c], [])
    run_flat(arc, ["d"], 2, cached)  # |T1| = 0 <= p: T2's LRU b goes to B2
    assert arc.lists() == ([d], [a], [c], [b])
    run_flat(arc, ["b"], 2, cached)  # |T1| = 1 = p: a goes to B2, then b's ghost hit in B2 shrinks p
    assert arc.p == 0 and arc.lists() == ([d], [b], [c], [a])


def test_arc_ghost_lists_stay_within_c_and_2c():
    arc, rng = ARCPolicy(capacity=8), random.Random(1)
    run_flat(arc, [rng.randint(0, 40) for _ in range(2000)], capacity=8)
    t1, t2, b1, b2 = arc.lists()
    assert len(t1) + len(t2) == 8 and len(t1) + len(b1) <= 8 and len(t1) + len(t2) + len(b1) + len(b2) <= 16
    assert 0 <= arc.p <= 8


# ---- S3-FIFO ----------------------------------------------------------------------------
def test_s3fifo_one_hit_wonders_leave_from_small_and_a_ghost_hit_goes_to_main():
    policy = S3FIFOPolicy(capacity=10)  # S: 1 block, M: 9, G: 9
    hot = [f"h{i}" for i in range(5)]
    wonders = [f"w{i}" for i in range(30)]
    hits, cached = run_flat(policy, hot + hot + wonders, capacity=10)
    small, main, ghost = policy.queues()
    assert hits == 5 and {k(h) for h in hot} <= cached
    assert main == [k(h) for h in hot]  # hit while in S: promoted; no one-hit wonder ever reached M
    assert small == [k(w) for w in wonders[25:]] and ghost == [k(w) for w in wonders[16:25]]  # G holds |M| = 9
    run_flat(policy, ["w20"], 10, cached)  # w25 leaves S for G; w20, a ghost, goes straight to M
    small, main, ghost = policy.queues()
    assert main[-1] == k("w20") and k("w20") not in ghost and ghost[-1] == k("w25")


def test_s3fifo_main_reinserts_blocks_with_hits_and_decrements_their_counter():
    x, y, z, w = k("x"), k("y"), k("z"), k("w")
    policy = S3FIFOPolicy(capacity=10)
    for key in (x, y, z, w):
        policy.on_insert(key)
        policy.on_release(key)
    for key in (x, y, z):
        policy.on_hit(key)
    assert policy.victim(always) == w  # x, y, z were hit in S: moved to M with bits cleared
    policy.on_remove(w)
    assert policy.queues() == ([], [x, y, z], [w])
    policy.on_hit(x)
    policy.on_hit(x)
    assert policy.victim(always) == y  # x is reinserted at M's head with its counter decremented
    assert policy.queues()[1] == [y, z, x] and policy.frequency(x) == 1 and policy.frequency(y) == 0


# ---- cost (PGDSF) ---------------------------------------------------------------------------
def test_cost_model_prices_later_blocks_higher():
    model = CostModel(num_layers=2, hidden=8, block_tokens=4, kv_hidden=8, dtype_bytes=2)
    assert model.recompute_flops(0) == 2 * (24 * 8 * 8 * 4 + 4 * 8 * 4 * 0.5 * 4)
    assert model.recompute_flops(3) - model.recompute_flops(2) == 2 * 4 * 8 * 4 * 4
    assert model.block_bytes() == 2 * 2 * 8 * 4 * 2
    with pytest.raises(ValueError, match="hidden"):
        CostModel(hidden=0)


def test_cost_keeps_deep_blocks_over_shallow_ones_at_equal_reuse_and_inflates_l():
    policy, model = CostPolicy(), CostModel()
    deep = [k(f"deep{d}") for d in range(6)]
    for d, key in enumerate(deep):
        policy.on_insert(key, d, deep[d - 1] if d else None)
    policy.on_insert(k("shallow"), 0, None)  # newer, but cheaper to recompute
    assert policy.victim(always) == k("shallow")
    policy.on_remove(k("shallow"))
    assert policy.inflation == pytest.approx(model.value_per_byte(0))
    policy.on_insert(k("fresh"), 0, None)  # L + cost: outranks the older, unused deep leaf
    assert policy.priority(k("fresh")) == pytest.approx(2 * model.value_per_byte(0))
    assert policy.victim(always) == deep[5]
    policy.on_hit(deep[5])  # two uses of a deep block beat one of a fresh shallow one
    assert policy.victim(always) == k("fresh")


# ---- OPT ----------------------------------------------------------------------------------
def test_opt_on_beladys_textbook_string_has_seven_faults_where_lru_has_nine():
    sequence = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2]
    requests = requests_of([[x] for x in sequence])
    assert replay_opt(requests, 3).block_hits == len(sequence) - 7
    assert replay(requests, "lru", 3).block_hits == len(sequence) - 9


def test_opt_evicts_never_used_again_first_then_farthest_then_deeper():
    future = FutureIndex({k("a"): [0, 5], k("b"): [0, 2], k("c"): [0, 2], k("d"): [0]})
    policy = OPTPolicy(future)
    policy.begin_request(0)
    policy.on_insert(k("b"), 1)
    policy.on_insert(k("c"), 4)
    policy.on_insert(k("a"), 0)
    policy.on_insert(k("d"), 0)
    assert policy.next_use(k("d")) == NEVER and policy.next_use(k("a")) == 5
    order = []
    while (victim := policy.victim(always)) is not None:
        order.append(victim)
        policy.on_remove(victim)
    assert order == [k("d"), k("a"), k("c"), k("b")]
    with pytest.raises(ValueError, match="future"):
        make_policy("opt")


def test_opt_reaches_the_ideal_hit_rate_with_room_and_beats_every_online_policy():
    requests = synthetic_trace()
    roomy = replay_opt(requests, 10_000)
    assert roomy.hit_rate == pytest.approx(ideal_hit_rate(requests))
    best = replay_opt(requests, 40).block_hits
    assert all(replay(requests, name, 40).block_hits <= best for name in ONLINE)


# ---- every policy ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*ONLINE, "opt"])
def test_victim_is_always_an_evictable_tracked_key(name: str):
    rng, policy, live = random.Random(7), build(name, 16), []
    for step in range(400):
        if live and rng.random() < 0.3:
            allowed = set(rng.sample(live, rng.randint(0, len(live))))
            victim = policy.victim(allowed.__contains__)
            assert (victim in allowed) if allowed else victim is None
            if victim is not None and rng.random() < 0.5:
                policy.on_remove(victim)
                live.remove(victim)
        elif live and rng.random() < 0.5:
            key = rng.choice(live)
            policy.on_hit(key)
            policy.on_release(key)
        else:
            live.append(k(step))
            policy.on_insert(live[-1])
            policy.on_release(live[-1])
    assert policy.victim(lambda key: False) is None
    assert len(policy) == len(live)


@pytest.mark.parametrize("name", [*ONLINE, "opt"])
def test_eviction_through_the_prefix_index_takes_only_free_leaves(name: str):
    policy = build(name, 12)
    index = PrefixReuseIndex(block_size=1, policy=policy)
    manager = BlockManager(12, 1, index)
    held: list[list[int]] = []
    rng = random.Random(3)
    for step in range(60):
        parent, blocks = None, manager.allocate(rng.randint(1, 4))
        if held and rng.random() < 0.5:  # extend a held chain
            base = rng.choice(held)
            parent = index.hash_of(base[-1])
        for i, block_id in enumerate(blocks):
            _, parent = manager.cache_block(block_id, parent, (step * 10 + i,), b"x")
        held.append(blocks)
        while manager.num_available_blocks < 4:  # keep room: release the oldest request, leaves first
            manager.free(list(reversed(held.pop(0))))
        manager.check_invariants()


class CheckedBlockManager(BlockManager):
    def free(self, block_ids: Sequence[int]) -> None:
        super().free(block_ids)
        self.check_invariants()


@pytest.mark.parametrize("name", [*ONLINE, "opt"])
@pytest.mark.parametrize("capacity", [8, 60])
def test_replay_keeps_block_manager_invariants(name: str, capacity: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(replay_module, "BlockManager", CheckedBlockManager)
    requests = synthetic_trace(80, seed=capacity, max_len=12)  # longer than 8 blocks: the replay truncates
    result = replay(requests, build(name, capacity, requests), capacity)
    assert result.requests == 80 and 0 <= result.prefix_hits <= result.block_hits <= result.accesses


def test_registered_names_build_the_new_policies():
    built = {"lfu": LFUPolicy, "arc": ARCPolicy, "s3fifo": S3FIFOPolicy, "cost": CostPolicy}
    for name, cls in built.items():
        policy = make_policy(name, capacity=32)
        assert isinstance(policy, cls) and policy.name == name
    arc, s3fifo = make_policy("arc", capacity=32), make_policy("s3fifo")
    assert isinstance(arc, ARCPolicy) and arc.c == 32
    assert isinstance(s3fifo, S3FIFOPolicy) and s3fifo.capacity is None and s3fifo.small_target == 1
