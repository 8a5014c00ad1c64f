"""`sage kv replay` with lower tiers counts the queued request's prefetch as the engine does (`PrefetchStats`):
traced by hand on tiny traces (LRU; device 2 blocks, host 4 or 2 blocks; no other tier)."""

from __future__ import annotations

import json

from sage_infer.sim.replay import TraceRequest
from sage_infer.sim.tiered import TierSpec, replay_tiered


def trace(*chains: list[int]) -> list[TraceRequest]:
    return [TraceRequest(i, 512 * len(ids), 1, list(ids)) for i, ids in enumerate(chains)]


# [1,2] then [3,4]: 1,2 go down to the host. [5,6] is admitted (3,4 still on the device) while [1,2] waits:
# its prefix is in the host tier, read ahead. [5,6] evicts 3,4 into the host; then [1,2] loads both
# prefetched blocks from the host: used.
CHAINS = ([1, 2], [3, 4], [5, 6], [1, 2])


def test_a_prefetched_prefix_the_next_request_loads_is_a_hit():
    result = replay_tiered(trace(*CHAINS), "lru", [TierSpec("device", 2), TierSpec("host", 4)])
    stats = result.prefetch.stats
    assert (stats.issued, stats.used, stats.blocks_read, stats.blocks_wasted) == (1, 1, 2, 0)
    assert stats.hit_ratio == 1.0 and result.tier_hits["host"] == 2


def test_a_prefetched_prefix_evicted_from_every_tier_first_is_wasted():
    # a host of 2 blocks: 3,4 coming down push 1,2 out of every tier after they were read ahead
    result = replay_tiered(trace(*CHAINS), "lru", [TierSpec("device", 2), TierSpec("host", 2)])
    stats = result.prefetch.stats
    assert (stats.issued, stats.used, stats.wasted["evicted"], stats.blocks_wasted) == (1, 0, 1, 2)
    assert stats.hit_ratio == 0.0 and result.tier_hits["host"] == 0


def test_the_replay_cli_reports_the_prefetch_hit_ratio_and_wasted_bytes(sage, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": ids})
                            + "\n" for i, ids in enumerate(CHAINS)))
    result = sage("kv", "replay", str(path), "--tiers", "device=2,host=2", "--json", "-")
    assert result.code == 0, result.err
    [lru] = json.loads(result.out)["results"]
    assert lru["prefetch"]["hit_ratio"] == 0.0 and lru["prefetch"]["wasted"]["evicted"] == 1
    assert lru["prefetch"]["bytes_wasted"] == lru["prefetch"]["bytes_read"] > 0  # both blocks read for nothing
    table = sage("kv", "replay", str(path), "--tiers", "device=2,host=4")
    assert table.code == 0 and "prefetch hit" in table.out and "100.00%" in table.out
