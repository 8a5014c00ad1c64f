"""`sage kv replay --replicas N`: a trace through N simulated replicas (the engine's KV manager each) behind the
router's own policies, fed by the replicas' own block events."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sage_infer.sim.customers import customers_trace
from sage_infer.sim.fleet import replay_fleet, trace_hashes
from sage_infer.sim.replay import TraceRequest, replay

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"


def customers(n_customers: int, turns: int, context_blocks: int, gap_ms: int = 1000) -> list[TraceRequest]:
    """Each customer's requests share `context_blocks` leading blocks, then one block of their own; `turns` requests
    per customer, in a shuffled order."""
    order = [c for c in range(n_customers) for _ in range(turns)]
    random.Random(0).shuffle(order)
    requests = []
    for i, c in enumerate(order):
        context = list(range(c * 100, c * 100 + context_blocks))
        requests.append(TraceRequest(i * gap_ms, 512 * (context_blocks + 1), 1, context + [10_000 + i]))
    return requests


def test_kv_routing_keeps_each_customer_on_one_replica_and_hits_like_one_big_cache():
    trace = customers(n_customers=4, turns=6, context_blocks=4)  # 4 x 5 blocks: one replica of 11 holds 2
    kv = replay_fleet(trace, "kv", replicas=2, capacity_blocks=11)
    spread = replay_fleet(trace, "round-robin", replicas=2, capacity_blocks=11)
    one = replay_fleet(trace, "round-robin", replicas=1, capacity_blocks=22)
    assert kv.prefix_hits >= one.prefix_hits  # as good as one cache of twice the size (2 customers per replica)
    assert spread.prefix_hits < 0.75 * kv.prefix_hits  # round-robin splits each customer over both replicas
    assert kv.routed == [12, 12] and kv.prediction_error == 0 and kv.predicted_hits == kv.prefix_hits
    assert kv.to_json()["compute_imbalance"] < 1.05


def test_one_replica_is_the_plain_replay():
    trace = customers(n_customers=3, turns=3, context_blocks=3)
    fleet = replay_fleet(trace, "kv", replicas=1, capacity_blocks=6)
    plain = replay(trace, "lru", 6)
    assert (fleet.prefix_hits, fleet.accesses) == (plain.prefix_hits, plain.accesses)


def test_a_busy_replica_loses_a_request_to_an_idle_one_when_recomputing_there_is_sooner():
    trace = [TraceRequest(0, 512 * 8, 1, list(range(8))), TraceRequest(0, 512 * 8, 1, list(range(100, 108))),
             TraceRequest(1, 512 * 9, 1, list(range(8)) + [50])]
    # 8 blocks at 4,000 tok/s: ~1 s each; the third arrives at 1 ms while replica 0 still computes its first
    result = replay_fleet(trace, "kv", replicas=2, capacity_blocks=32)
    assert result.routed == [2, 1] and result.prefix_hits == 8
    slow = replay_fleet(trace, "kv", replicas=2, capacity_blocks=32, prefill_tokens_per_s=1e9)
    assert slow.prefix_hits == 8  # with compute this cheap the queue hardly matters: still the prefix's replica


def test_trace_hashes_match_the_replica_caches_names():
    request = TraceRequest(0, 1024, 1, [7, 8])
    result = replay_fleet([request, request], "kv", replicas=1, capacity_blocks=4)
    assert len(trace_hashes(request)) == 2 and result.predicted_hits == 2 and result.prefix_hits == 2


def test_the_cli_prints_a_table_and_writes_json(sage, tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": 1, "hash_ids": r.hash_ids}
            for r in customers(4, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "fleet.json"
    result = sage("kv", "replay", str(path), "--replicas", "1,2", "--routing", "kv,session", "--capacity", "10",
                  "--json", str(out))
    assert result.code == 0, result.err
    assert "÷ one replica" in result.out and "session" in result.out
    document = json.loads(out.read_text())
    assert {(r["replicas"], r["routing"]) for r in document["results"]} == {(1, "kv"), (1, "session"), (2, "kv"),
                                                                           (2, "session")}
    assert set(document["one_replica"]) == {"1", "2"}
    for argv, message in ((["--replicas", "0"], "expected replica counts"),
                          (["--replicas", "2", "--routing", "nearest"], "--routing 'nearest'"),
                          (["--replicas", "2", "--tiers", "host=10"], "not implemented yet"),
                          (["--replicas", "2", "--policy", "lru,arc"], "one eviction --policy")):
        bad = sage("kv", "replay", str(path), *argv)
        assert bad.code == 2 and message in bad.err, bad.err


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"{REAL_TRACE} is not here")
def test_on_the_mooncake_trace_kv_routing_beats_round_robin_and_nears_one_shared_cache():
    from sage_infer.sim.replay import load_mooncake

    trace = load_mooncake(REAL_TRACE)[:2000]
    kv = replay_fleet(trace, "kv", replicas=8, capacity_blocks=2000).to_json()
    spread = replay_fleet(trace, "round-robin", replicas=8, capacity_blocks=2000).to_json()
    one = replay_fleet(trace, "round-robin", replicas=1, capacity_blocks=8 * 2000).to_json()
    assert kv["prefix_hit_rate"] > 1.2 * spread["prefix_hit_rate"]
    assert kv["compute_imbalance"] < 1.2  # and it balances the work
    assert one["prefix_hit_rate"] > 0
    # the index follows every event; what it still gets wrong is what LRU evicts between routing and start
    assert kv["prediction_error"] < 0.01


def test_past_saturation_kv_routing_keeps_its_predictions_and_its_lead_over_round_robin():
    # 6 customers of skewed popularity, 2 replicas caching 2 contexts each, at ~1.5x what round-robin can serve: a
    # request's prefix is evicted by the queue ahead before its turn unless the router accounts for that queue
    trace = customers_trace(6, context_blocks=4, rate=6.0, duration_s=60.0, zipf=1.0)
    kv = replay_fleet(trace, "kv", replicas=2, capacity_blocks=9).to_json()
    spread = replay_fleet(trace, "round-robin", replicas=2, capacity_blocks=9).to_json()
    assert kv["prefix_hit_rate"] > 1.3 * spread["prefix_hit_rate"]
    assert kv["ttft_s"]["p90"] < 0.5 * spread["ttft_s"]["p90"]
    assert kv["prediction_error"] < 0.25  # counting every block the index shows as a hit errs by ~0.8 here
