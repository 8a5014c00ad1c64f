"""Hybrid (sliding-window) models in a fleet: the KV events a replica logs per KV group, the router's prefix hit per
group (every full-attention block of the prefix, only the window's blocks of a sliding group), the same as the
engine's own hit."""

from __future__ import annotations

import random

import pytest

from sage_infer.core.sampling_params import SamplingParams as Params
from sage_infer.core.sequence import Sequence
from sage_infer.kv_policy.group_hit import group_key, window_needs
from sage_infer.kv_policy.routing import FleetIndex, Request, Router
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.kv_groups import kv_groups
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import prompt_block_hashes
from sage_infer.prefix_reuse.index import PrefixReuseIndex

BS = 16


def test_a_fleet_hit_needs_every_full_block_and_only_the_window_of_a_sliding_group():
    index = FleetIndex(["a"])
    replica = index.replica("a")
    names = [f"{i:016x}" for i in range(6)]
    needs = window_needs([{"kind": "full_attention", "sliding_window": None},
                          {"kind": "sliding_window", "sliding_window": 2 * BS}], BS)
    assert needs == (-1, 2)
    for name in names:
        index.apply(replica, "stored", "device", group_key(name, 0))
    for name in names[3:]:  # the sliding group kept its window of the 6 blocks (and one more)
        index.apply(replica, "stored", "device", group_key(name, 1))
    assert index.hit(replica, names, needs).blocks == 6
    assert index.hit(replica, names, ()).blocks == 6  # the plain chain: group 0 alone
    index.apply(replica, "removed", "device", group_key(names[5], 1))  # the window of 6 lacks its last block
    assert index.hit(replica, names, needs).blocks == 5  # blocks 3 and 4: the window of a 5-block prefix
    index.apply(replica, "removed", "device", group_key(names[2], 0))  # full group: blocks 0..1 only
    assert index.hit(replica, names, needs).blocks == 0  # and the sliding group holds neither 0 nor 1
    route = Router(index).route(Request(prompt_tokens=6 * BS + 1, hashes=names, tokens_per_block=BS,
                                        group_needs=needs))
    assert route.hit.blocks == 0 and route.compute_tokens == 6 * BS + 1
    assert set(route.blocks) == {*names, *(group_key(n, 1) for n in names[4:])}  # what it holds once computed


@pytest.mark.parametrize("windows", [(9, None, 9), (9, 9)], ids=["full-and-sliding", "sliding-only"])
def test_the_routers_hit_from_a_replicas_group_events_is_the_engines_own(windows):
    """Random prompts sharing prefixes through a small pool of a KV manager with groups (stores, frees out of the
    window, evictions): a fleet index fed its events (and later its snapshot) and asked with the prompt's hashes as a
    router computes them predicts exactly the prefix the engine's `match` serves."""
    rng = random.Random(7)
    bs = 4
    groups = kv_groups(windows)
    index = PrefixReuseIndex(bs)
    events = index.enable_events()
    events.grouped = True
    kv = GroupKVCacheManager(BlockManager(12 * len(groups.groups), bs, index), groups)
    needs = window_needs([{"kind": "full_attention" if g.window is None else "sliding_window",
                           "sliding_window": g.window} for g in groups.groups], bs)
    assert needs == tuple(groups.window_blocks(g, bs) for g in range(len(groups.groups)))
    fleet = FleetIndex(["r"])
    replica = fleet.replica("r")
    cursor = -1

    def follow() -> None:
        nonlocal cursor
        read = events.read(cursor)
        if read.reset:
            fleet.reset(replica, read.snapshot)
        for op, medium, key, *_ in read.events:
            fleet.apply(replica, op, medium, key)
        cursor = read.next

    stems = [[rng.randrange(50) for _ in range(30)] for _ in range(3)]
    running: list[Sequence] = []
    checked = hits = 0
    for step in range(300):
        if len(running) < 3 and rng.random() < 0.4:
            tokens = rng.choice(stems)[: rng.randrange(5, 30)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            seq = Sequence(step, str(step), 0, tokens, len(tokens), Params(), b"k")
            match = kv.match(seq)
            follow()
            names = [short(h) for h in prompt_block_hashes(tokens, bs, b"k")]
            assert fleet.hit(replica, names, needs).blocks * bs == match.num_tokens
            checked, hits = checked + 1, hits + bool(match.num_tokens)
            if kv.admit(seq, match, rng.randrange(1, len(tokens) - match.num_tokens + 1)):
                running.append(seq)
            continue
        if not running:
            continue
        seq = rng.choice(running)
        if seq.num_computed_tokens >= seq.num_tokens or rng.random() < 0.1:
            kv.free(seq)
            running.remove(seq)
            continue
        seq.num_computed_tokens = min(seq.num_tokens, len(seq.block_table) * bs)
        kv.commit(seq)
        if seq.num_computed_tokens < seq.num_tokens and not kv.allocate(seq, bs):
            kv.free(seq)
            running.remove(seq)
    assert checked >= 40 and hits >= 10 and events.read(0).reset is False
    removed = [e for e in events.read(max(0, cursor - 200)).events if e[0] == "removed"]
    assert removed and all(e[5] is not None for e in removed)  # evictions, each naming its group
    follow()
    before = {m: set(v) for m, v in replica.media.items()}
    fleet.reset(replica, events.read(-1).snapshot)  # a router that reconnects: the snapshot names the same keys
    assert {m: set(v) for m, v in replica.media.items()} == before
