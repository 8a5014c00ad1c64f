"""Hybrid (sliding-window) models in a fleet: the KV events a replica logs per KV group, the router's prefix hit per
group (every full-attention block of the prefix, only the window's blocks of a sliding group), the same as the
engine's own hit."""

from __future__ import annotations

from sage_infer.kv_policy.group_hit import group_key, window_needs
from sage_infer.kv_policy.routing import FleetIndex, Request, Router

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
