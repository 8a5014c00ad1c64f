"""The fleet's routing decisions, without servers: the block index fed by KV events (every medium), the policies,
the engine's own event log, and how `--replicas` splits the cores."""

from __future__ import annotations

import pytest

from sage_infer.errors import UsageError
from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.migration import BlockMeta, LowerTier
from sage_infer.kv_policy.routing import FleetIndex, Hit, Request, Route, Router
from sage_infer.prefix_reuse.events import BlockEvents, short
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from sage_infer.router.replicas import split_cores

BS = 16


def fleet(*names: str, capacity_blocks: int = 1000) -> FleetIndex:
    """Replicas with room to spare in their device caches (unless `capacity_blocks` says otherwise)."""
    index = FleetIndex(list(names))
    for replica in index.replicas:
        replica.capacity_blocks = capacity_blocks
    return index


def test_a_hit_is_the_device_prefix_then_the_lower_tiers_right_after_it():
    index = fleet("a", "b")
    a, b = index.replicas
    index.reset(a, {"device": ["h0", "h1"], "host": ["h2"], "disk": ["h3"]})
    index.apply(b, "stored", "remote", "h4")  # b wrote it to the shared tier: a can load it too
    assert index.hit(a, ["h0", "h1", "h2", "h3", "h4", "h5"]) == Hit(2, (("host", 1), ("disk", 1), ("remote", 1)))
    assert index.hit(b, ["h0"]) == Hit(0, ())
    index.apply(a, "removed", "device", "h1")
    assert index.hit(a, ["h0", "h1", "h2"]) == Hit(1, ())  # h1 gone: h2 is not reached


def test_the_shared_tier_counts_a_block_while_any_replica_reports_it():
    index = fleet("a", "b")
    a, b = index.replicas
    index.apply(a, "stored", "remote", "x")
    index.apply(b, "stored", "remote", "x")
    index.apply(a, "removed", "remote", "x")
    assert index.hit(a, ["x"]).lower_blocks == (("remote", 1),)
    index.drop(b)  # b died: what only it reported is gone
    assert index.hit(a, ["x"]) == Hit(0, ())
    assert index.blocks_in(a, "remote") == 0


def test_a_snapshot_replaces_everything_known_of_a_replica():
    index = fleet("a")
    [a] = index.replicas
    index.reset(a, {"device": ["old"]})
    index.reset(a, {"device": ["new"], "host": ["h"]})
    assert index.hit(a, ["old"]) == Hit(0, ()) and index.hit(a, ["new", "h"]) == Hit(1, (("host", 1),))


def test_blocks_the_queue_ahead_evicts_are_not_counted_and_blocks_it_computes_are():
    index = fleet("a", capacity_blocks=4)
    [a] = index.replicas
    for block_hash in ("p0", "p1", "q0", "q1"):  # used in this order: p is the least recently used prefix
        index.apply(a, "stored", "device", block_hash)
    assert index.doomed(a) == frozenset() and index.hit(a, ["p0", "p1"]) == Hit(2, ())
    index.touch(a, ["q0", "q1", "n0", "n1"])
    a.take(2 * BS, ["q0", "q1", "n0", "n1"])  # in flight: q hits, n0 and n1 will be computed there
    assert a.to_allocate == 2
    assert index.doomed(a) == {"p0", "p1"}  # the 2 new blocks evict the 2 least recently used: p's
    assert index.hit(a, ["p0", "p1"]) == Hit(0, ())
    assert index.hit(a, ["q0", "q1", "n0", "n1", "z"]) == Hit(4, ())  # what the request ahead computes is a hit
    later = [f"x{i}" for i in range(6)]  # unless 1.5 capacities of other blocks will be used after it
    index.touch(a, later)
    a.take(0, later)
    assert index.hit(a, ["q0", "q1", "n0", "n1"]) == Hit(0, ())
    a.release(0, blocks=later)
    index.reset(b := index.add("b"), {"device": [], "host": []})  # a replica with a host tier demotes its victims
    b.capacity_blocks = 4
    for block_hash in ("p0", "p1", "q0", "q1"):
        index.apply(b, "stored", "device", block_hash)
    b.take(2 * BS, ["n0", "n1"])
    assert index.hit(b, ["p0", "p1"]) == Hit(0, (("host", 2),))  # loaded back, not computed
    index.apply(a, "removed", "device", "p0")  # n0 computed in p0's place: one fewer block to come
    index.apply(a, "stored", "device", "n0")
    assert a.to_allocate == 1 and index.doomed(a) == {"p1"}
    a.release(2 * BS, blocks=["q0", "q1", "n0", "n1"])
    assert a.to_allocate == 0 and not a.held and index.doomed(a) == frozenset()


def test_kv_routing_does_not_count_on_a_prefix_the_queue_ahead_will_evict():
    index = fleet("a", "b", capacity_blocks=4)
    a, b = index.replicas
    router = Router(index, "kv")
    for block_hash in ("p0", "p1"):
        index.apply(a, "stored", "device", block_hash)
    busy = router.route(Request(4 * BS, ["x0", "x1", "x2", "x3"], BS), exclude={"b"})
    a.take(busy.compute_tokens, busy.blocks)  # 4 new blocks queued at a: its cache turns over before p's turn
    route = router.route(Request(3 * BS, ["p0", "p1", "t"], BS))
    assert route.replica is b and route.hit == Hit(0, ()) and not route.moved
    b.take(route.compute_tokens, route.blocks)
    follower = router.route(Request(3 * BS, ["p0", "p1", "u"], BS))  # the next request of that prefix follows it
    assert follower.replica is b and follower.hit.blocks == 2


def test_kv_routing_goes_where_the_prefix_is_until_the_queue_there_costs_more_than_recomputing():
    index = fleet("a", "b")
    a, b = index.replicas
    hashes = [f"h{i}" for i in range(8)]
    index.reset(a, {"device": hashes})
    router = Router(index, "kv")
    request = Request(prompt_tokens=8 * BS + 3, hashes=hashes, tokens_per_block=BS)
    route = router.route(request)
    assert route.replica is a and route.hit.blocks == 8
    a.queued_tokens = 8 * BS * 4  # a is busy computing other prompts: recomputing on idle b is faster
    assert router.route(request).replica is b
    assert router.route(request, exclude={"b"}).replica is a


def test_on_full_caches_a_prefix_moves_only_when_its_replica_is_far_busier():
    index = fleet("a", "b", capacity_blocks=8)  # both caches full: a move evicts someone else's prefix
    a, b = index.replicas
    hashes = [f"h{i}" for i in range(8)]
    index.reset(a, {"device": hashes})
    index.reset(b, {"device": [f"other{i}" for i in range(8)]})
    router = Router(index, "kv")
    request = Request(prompt_tokens=8 * BS + 3, hashes=hashes, tokens_per_block=BS)
    a.queued_tokens = 8 * BS * 4  # would move it with room to spare (the test above), not here
    assert router.route(request).replica is a
    a.queued_tokens = 8 * BS * 40
    assert router.route(request).replica is b


def test_kv_routing_prefers_a_lower_tier_hit_to_recomputing_and_charges_decoding_requests():
    index = fleet("a", "b")
    a, b = index.replicas
    hashes = ["h0", "h1"]
    index.reset(b, {"host": hashes})
    router = Router(index, "kv")
    request = Request(prompt_tokens=2 * BS + 1, hashes=hashes, tokens_per_block=BS)
    assert router.route(request).replica is b
    b.outstanding = 4  # four requests in flight there outweigh loading two blocks from host
    assert router.predicted_ttft_s(b, Hit(0, (("host", 2),)), request) > router.predicted_ttft_s(a, Hit(), request)
    assert router.route(request).replica is a


def test_the_router_learns_the_prefill_rate_and_what_a_request_ahead_costs():
    index = fleet("a", "b")
    a, b = index.replicas
    hashes = [f"h{i}" for i in range(64)]
    index.reset(a, {"device": hashes})
    router = Router(index, "kv", prefill_tokens_per_s=4000, seconds_per_request_ahead=0.001)
    for _ in range(30):  # alone on its replica, 2,000 tokens took 1 s: 2,000 tok/s
        router.learn(Route(b, Hit(), 0.5, ahead=0, queued_tokens=0, compute_tokens=2000), 1.0)
    assert router.prefill_tokens_per_s == pytest.approx(2000, rel=0.01)
    request = Request(prompt_tokens=64 * BS + 1, hashes=hashes, tokens_per_block=BS)
    a.outstanding = 20  # a crowd decoding on the prefix's replica
    assert router.route(request).replica is a  # at 1 ms each, it still looks cheaper than recomputing on b
    for _ in range(30):  # but a cached request behind 20 others waited 4 s: 0.2 s each
        router.learn(Route(a, Hit(64), 0.1, ahead=20, queued_tokens=0, compute_tokens=1), 4.0)
    assert router.seconds_per_request_ahead == pytest.approx(0.2, rel=0.01)
    assert router.route(request).replica is b  # recomputing on idle b (0.5 s) beats 4 s in a's queue


def test_the_simple_policies():
    index = fleet("a", "b", "c")
    router = Router(index, "round-robin")
    assert [router.route(Request(1)).replica.name for _ in range(4)] == ["a", "b", "c", "a"]
    index.replicas[1].up = False  # a replica out of the routing is skipped
    assert {router.route(Request(1)).replica.name for _ in range(4)} == {"a", "c"}
    index.replicas[1].up = True
    least = Router(index, "least-load")
    index.replicas[0].outstanding, index.replicas[2].outstanding = 3, 1
    assert least.route(Request(1)).replica.name == "b"
    session = Router(index, "session")
    chosen = {session.route(Request(1, session="user:alice")).replica.name for _ in range(5)}
    assert len(chosen) == 1  # a session sticks to one replica
    spread = {session.route(Request(1, session=f"user:{i}")).replica.name for i in range(40)}
    assert spread == {"a", "b", "c"}  # and sessions spread over all of them
    randomly = Router(index, "random", seed=1)
    assert {randomly.route(Request(1)).replica.name for _ in range(40)} == {"a", "b", "c"}
    with pytest.raises(ValueError, match="routing 'bogus'"):
        Router(index, "bogus")
    for replica in index.replicas:
        replica.up = False
    assert least.route(Request(1)) is None


def test_a_session_moves_only_when_its_replica_leaves():
    index = fleet(*"abcd")
    router = Router(index, "session")
    before = {i: router.route(Request(1, session=str(i))).replica.name for i in range(50)}
    index.replica("b").up = False
    after = {i: router.route(Request(1, session=str(i))).replica.name for i in range(50)}
    assert all(after[i] == before[i] for i in range(50) if before[i] != "b")
    assert all(after[i] != "b" for i in range(50))


def test_the_engine_logs_device_and_lower_tier_events_in_one_ordered_stream():
    index = PrefixReuseIndex(2, make_policy("lru", capacity=8))
    events = index.enable_events()
    host = LowerTier("host", 1, make_policy("lru", capacity=1))
    events.add_medium("host", host.blocks.keys)
    host.listener = lambda op, key: (events.stored if op == "stored" else events.removed)(key, "host")
    h0, _ = index.insert(0, None, [1, 2], b"k")
    first = events.read(-1)
    assert first.reset and first.snapshot == {"device": [short(h0)], "host": []}
    index.remove(0)
    host.insert(h0, BlockMeta(tokens=2, depth=0, parent=None))  # demoted to host
    host.insert(b"z" * 32, BlockMeta(tokens=2, depth=0, parent=None))  # the host tier holds one block: h0 leaves it
    later = events.read(first.next)
    assert not later.reset and [e[:3] for e in later.events] == [
        ("removed", "device", short(h0)), ("stored", "host", short(h0)), ("removed", "host", short(h0)),
        ("stored", "host", short(b"z" * 32))]
    assert first.next == 1 and events.read(0).events[0] == ("stored", "device", short(h0), None, (1, 2), None)
    assert events.read(later.next).events == []
    assert events.since(0).events == [f"+{short(h0)}", f"-{short(h0)}"]  # the polled view: the device's only


def test_a_reader_too_far_behind_gets_every_medium_again():
    held = {b"a" * 32}
    events = BlockEvents(lambda: held, capacity=2)
    events.add_medium("disk", lambda: [b"d" * 32])
    for key in (b"x" * 32, b"y" * 32, b"z" * 32):
        events.stored(key, "disk")
    read = events.read(0)
    assert read.reset and read.snapshot == {"device": [short(b"a" * 32)], "disk": [short(b"d" * 32)]}


def test_replicas_get_disjoint_core_shares_within_numa_nodes():
    numa = {cpu: cpu // 4 for cpu in range(8)}  # two nodes of four cores
    assert split_cores(2, list(range(8)), numa) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cores(4, list(range(8)), numa) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_cores(3, [0, 1, 2], {}) == [[0], [1], [2]]
    interleaved = {cpu: cpu % 2 for cpu in range(4)}  # node 0: cores 0, 2; node 1: 1, 3
    assert split_cores(2, list(range(4)), interleaved) == [[0, 2], [1, 3]]
    with pytest.raises(UsageError, match="--replicas 3: this machine gives 2 cores"):
        split_cores(3, [0, 1], {})
    with pytest.raises(UsageError, match="--replicas 0"):
        split_cores(0, [0, 1], {})


def test_among_equal_choices_a_miss_goes_to_the_replica_that_computed_least_lately():
    index = fleet("a", "b", "c")
    a, b, c = index.replicas
    router = Router(index, "kv")
    big = Request(prompt_tokens=40 * BS, hashes=[f"big{i}" for i in range(40)], tokens_per_block=BS)
    first = router.route(big).replica
    assert first.recent_work == 40 * BS  # what it was sent to compute
    # small prompts found nowhere: they go to the two others in turn (by turn alone one would land on `first` too)
    smalls = [router.route(Request(prompt_tokens=BS, hashes=[f"s{i}"], tokens_per_block=BS)).replica
              for i in range(6)]
    assert first not in smalls and {r.name for r in smalls} == {r.name for r in (a, b, c) if r is not first}


def test_the_recency_order_finds_the_kth_oldest_evictable_block_as_a_list_would():
    import random as _random

    from sage_infer.kv_policy.recency import MIN_SIZE, RecencyOrder

    rng = _random.Random(3)
    order, naive, evictable = RecencyOrder(), [], set()  # naive: blocks oldest first
    for step in range(4 * MIN_SIZE):  # past several renumberings
        block = f"b{rng.randrange(300)}"
        action = rng.random()
        if action < 0.6:
            order.touch(block, keep=lambda h: True)
            naive = [b for b in naive if b != block] + [block]
        elif action < 0.8 and block in order:
            flag = rng.random() < 0.7
            order.set_evictable(block, flag)
            (evictable.add if flag else evictable.discard)(block)
        elif action < 0.9:
            order.discard(block)
            naive = [b for b in naive if b != block]
            evictable.discard(block)
        if step % 97 == 0:
            eligible = [b for b in naive if b in evictable]
            for k in (1, len(eligible) // 2, len(eligible)):
                if k:
                    threshold = order.oldest_evictable_stamp(k)
                    assert {b for b in naive if order.among_oldest(b, threshold)} == set(eligible[:k])
            for block in naive[:: max(1, len(naive) // 5)]:
                assert order.newer_than(block) == len(naive) - 1 - naive.index(block)  # its LRU stack distance
