"""`sage kv replay`: trace replay through the production prefix cache, per policy and per tier.

Hit counts on the small traces are traced by hand in the comments; the CLI is driven
through the mounted `sage kv` command.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from sage_infer.cli import kv
from sage_infer.config.presets import load_hardware_preset
from sage_infer.kv_policy import POLICIES
from sage_infer.kv_policy.cost_benefit import CostBenefitModel, ModelShape
from sage_infer.sim.replay import TraceRequest, replay
from sage_infer.sim.tiered import TierSpec, all_policies, replay_tiered, run_capacity

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"

# LRU, 3 blocks (a request releases its blocks leaf first, so its root ends most recent):
#   [0,1,2] miss x3                     cache 0,1,2   LRU order 2,1,0
#   [0,1,3] hits 0,1; evicts 2          cache 0,1,3   order 3,1,0
#   [0,1,2] hits 0,1; evicts 3          cache 0,1,2   order 2,1,0
#   [4,5]   miss x2;  evicts 2 then 1   cache 0,4,5
#   [0,1]   hits 0;   evicts 5
# 13 accesses, 5 prefix hits (= block hits); 6 distinct blocks, so ideal = 7/13.
HAND_TRACE = [[0, 1, 2], [0, 1, 3], [0, 1, 2], [4, 5], [0, 1]]
RESULT_KEYS = {"policy", "hit_rate", "prefix_hit_rate", "tier_hits", "prefill_seconds_saved", "us_per_access",
               "prefetch"}
DOC_KEYS = {"trace", "requests", "accesses", "distinct", "capacity_blocks", "ideal_hit_rate", "opt", "results"}


@pytest.fixture
def sage_kv(sage):
    """Run `sage kv ...` in-process through the mounted CLI: ``sage_kv("replay", trace, "--capacity", "3")``."""
    return lambda *argv: sage("kv", *(str(a) for a in argv))


def write_trace(path: Path, chains: list[list[int]]) -> Path:
    rows = [{"timestamp": i * 1000, "input_length": 512 * len(c), "output_length": 1, "hash_ids": c}
            for i, c in enumerate(chains)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def requests_of(chains: list[list[int]]) -> list[TraceRequest]:
    return [TraceRequest(i * 1000, 512 * len(c), 1, c) for i, c in enumerate(chains)]


@pytest.fixture
def hand_trace(tmp_path) -> Path:
    return write_trace(tmp_path / "hand.jsonl", HAND_TRACE)


def replay_json(sage_kv, *argv) -> dict:
    result = sage_kv("replay", *argv, "--json", "-")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_lru_hits_match_the_hand_trace(sage_kv, hand_trace):
    doc = replay_json(sage_kv, hand_trace, "--capacity", "3", "--policy", "lru")
    assert (doc["requests"], doc["accesses"], doc["distinct"], doc["capacity_blocks"]) == (5, 13, 6, 3)
    assert doc["ideal_hit_rate"] == pytest.approx(7 / 13)
    [lru] = doc["results"]
    assert lru["policy"] == "lru"
    assert lru["hit_rate"] == pytest.approx(5 / 13)
    assert lru["prefix_hit_rate"] == pytest.approx(5 / 13)
    assert lru["tier_hits"] == {"device": 5}
    assert lru["prefill_seconds_saved"] is None  # no --preset, no prices


def test_json_file_has_exactly_the_documented_shape(sage_kv, hand_trace, tmp_path):
    out = tmp_path / "replay.json"
    result = sage_kv("replay", hand_trace, "--capacity", "3", "--policy", "all", "--json", out)
    assert result.code == 0, result.err
    assert "lru" in result.out  # the table is still printed
    doc = json.loads(out.read_text())
    assert set(doc) == DOC_KEYS
    assert doc["opt"] is None or set(doc["opt"]) == {"hit_rate", "prefix_hit_rate"}
    assert [r["policy"] for r in doc["results"]] == all_policies()
    assert "opt" not in [r["policy"] for r in doc["results"]]
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        assert isinstance(r["hit_rate"], float) and isinstance(r["us_per_access"], float)


def test_several_capacities_are_written_as_a_capacities_list(sage_kv, hand_trace):
    doc = replay_json(sage_kv, hand_trace, "--capacity", "3,100%")
    assert set(doc) == {"capacities"}
    assert [d["capacity_blocks"] for d in doc["capacities"]] == [3, 6]
    assert all(set(d) == DOC_KEYS for d in doc["capacities"])
    big = doc["capacities"][1]["results"][0]
    assert big["prefix_hit_rate"] == pytest.approx(7 / 13)  # every distinct block fits: the ideal


@pytest.mark.parametrize(
    ("spec", "blocks"),
    [("50%", 3), ("5", 5), ("1024tok", 2), ("4.6Mtok", 8984), ("128MiB", 2), ("2GiB", 32), ("0.2GB", 2)],
)
def test_capacity_accepts_percent_blocks_tokens_and_bytes(spec, blocks):
    block_bytes = ModelShape().kv_bytes_per_token * 512  # Llama-3-8B bf16: 64 MiB per 512-token block
    assert block_bytes == 64 * 2**20
    assert kv.capacity_blocks(spec, 6, block_bytes) == blocks


def test_a_block_evicted_from_device_is_found_in_host(sage_kv, hand_trace):
    # as the hand trace, but evicted blocks go to host (10 blocks) instead of away:
    #   [0,1,3] evicts 2 -> host;  [0,1,2] finds 2 in host (host hit), evicts 3 -> host
    #   [4,5] evicts 2, 1 -> host; [0,1] finds 1 in host. 5 device + 2 host = the ideal 7.
    doc = replay_json(sage_kv, hand_trace, "--tiers", "device=3,host=10")
    [lru] = doc["results"]
    assert lru["tier_hits"] == {"device": 5, "host": 2}
    assert lru["prefix_hit_rate"] == pytest.approx(7 / 13)
    assert doc["capacity_blocks"] == 3


def test_device_tier_of_the_tiered_replay_is_the_production_replay():
    rng = random.Random(7)
    convs = [[0, *rng.sample(range(1, 10_000), 6)] for _ in range(12)]
    chains = [conv[: rng.randint(1, 7)] for conv in rng.choices(convs, k=200)]
    requests = requests_of(chains)
    for name in all_policies():
        for capacity in (4, 13, 40):
            tiered = replay_tiered(requests, name, [TierSpec("device", capacity)])
            plain = replay(requests, name, capacity, keep_per_request=True)
            assert tiered.per_request_prefix_hits == plain.per_request_prefix_hits, (name, capacity)
            assert (tiered.block_hits, tiered.tier_hits) == (plain.block_hits, {"device": plain.prefix_hits})


def test_blocks_not_worth_loading_from_a_tier_are_dropped_not_demoted():
    requests = requests_of(HAND_TRACE)
    tiers = [TierSpec("device", 3), TierSpec("disk", 10)]
    h100 = load_hardware_preset("nvidia-h100").profile
    fast = replay_tiered(requests, "lru", tiers, CostBenefitModel(h100, disk_gb_s=7.0))
    slow = replay_tiered(requests, "lru", tiers, CostBenefitModel(h100, disk_gb_s=0.5))  # 134 ms a block
    assert fast.tier_hits == {"device": 5, "disk": 2}
    assert slow.tier_hits == {"device": 5, "disk": 0}


def test_cost_model_arithmetic_on_h100_and_cpu():
    h100 = CostBenefitModel(load_hardware_preset("nvidia-h100").profile)
    cpu = CostBenefitModel(load_hardware_preset("cpu").profile)
    nbytes = h100.kv_bytes(512)
    assert nbytes == 512 * 2 * 32 * 8 * 128 * 2
    # recompute: 2 * 8.03e9 * 512 weight FLOPs + 4 * 32 * 4096 * (512 * 512 + 512 * 513 / 2) attention FLOPs
    flops = 2 * 8.03e9 * 512 + 4 * 32 * 4096 * (512 * 512 + 512 * 513 / 2)
    assert h100.recompute_seconds(512, 1) == pytest.approx(flops / (989e12 * 0.5))
    assert cpu.recompute_seconds(512, 1) == pytest.approx(flops / (5e12 * 0.5))  # cpu preset: fallback TFLOP/s
    assert h100.recompute_seconds(512, 8) > h100.recompute_seconds(512, 0)  # deeper blocks attend to more
    assert h100.load_seconds("device", nbytes) == 0.0
    assert h100.load_seconds("host", nbytes) == pytest.approx(nbytes / 64e9)  # PCIe Gen5 x16, one way
    assert cpu.load_seconds("host", nbytes) == pytest.approx(nbytes / 50e9)
    assert h100.load_seconds("disk", nbytes) == pytest.approx(nbytes / 5e9)
    assert h100.load_seconds("remote", nbytes) == pytest.approx(nbytes / (8 * 400 / 8 / 8 * 1e9))  # 1 NIC per GPU
    assert cpu.load_seconds("remote", nbytes) == pytest.approx(nbytes / (2 * 25 / 8 * 1e9))
    assert h100.worth_loading("host", 512, 0) and cpu.worth_loading("host", 512, 0)
    # a 0.5 GB/s disk loses to an H100 recomputing, but still beats a CPU recomputing
    slow_disk_h100 = CostBenefitModel(h100.profile, disk_gb_s=0.5)
    slow_disk_cpu = CostBenefitModel(cpu.profile, disk_gb_s=0.5)
    assert not slow_disk_h100.worth_loading("disk", 512, 0)
    assert slow_disk_cpu.worth_loading("disk", 512, 0)


def test_preset_prices_hits_in_prefill_seconds(sage_kv, hand_trace):
    doc = replay_json(sage_kv, hand_trace, "--capacity", "3", "--preset", "nvidia-h100")
    h100 = CostBenefitModel(load_hardware_preset("nvidia-h100").profile)
    # device hits: depth 0 three times (requests 2, 3, 5), depth 1 twice (requests 2, 3); loads cost nothing
    expected = 3 * h100.recompute_seconds(512, 0) + 2 * h100.recompute_seconds(512, 1)
    assert doc["results"][0]["prefill_seconds_saved"] == pytest.approx(expected)


def test_opt_missing_is_reported_as_null_with_a_reason(sage_kv, hand_trace, monkeypatch):
    monkeypatch.setitem(sys.modules, "sage_infer.sim.opt", None)  # import now fails
    result = sage_kv("replay", hand_trace, "--capacity", "3", "--json", "-")
    assert result.code == 0, result.err
    assert json.loads(result.out)["opt"] is None
    assert "OPT not reported: sage_infer.sim.opt" in result.err


@pytest.mark.skipif("opt" not in POLICIES, reason="kv_policy.opt is not written yet")
def test_opt_is_reported_from_replay_opt(sage_kv, hand_trace):
    from sage_infer.sim.opt import replay_opt

    doc = replay_json(sage_kv, hand_trace, "--capacity", "3")
    expected = replay_opt(requests_of(HAND_TRACE), 3)
    assert doc["opt"] == {"hit_rate": expected.hit_rate, "prefix_hit_rate": expected.prefix_hit_rate}


def test_plot_writes_a_png(sage_kv, hand_trace, tmp_path):
    out = tmp_path / "curves.png"
    result = sage_kv("replay", hand_trace, "--capacity", "2,3,6", "--plot", out)
    assert result.code == 0, result.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.jsonl"], "trace file not found"),
        (["BAD", "--capacity", "3"], "bad.jsonl:2: malformed trace line"),
        (["HAND", "--policy", "lru,belady"], "unknown eviction policy 'belady'"),
        (["HAND", "--policy", "opt"], "OPT is always reported"),
        (["HAND", "--capacity", "0"], "capacity must be > 0"),
        (["HAND", "--capacity", "-5%"], "capacity must be > 0"),
        (["HAND", "--capacity", "lots"], "expected a percent of distinct blocks"),
        (["HAND", "--capacity", "1KiB"], "less than one block"),
        (["HAND", "--tiers", "gpu=5%"], "unknown tier 'gpu'"),
        (["HAND", "--tiers", "device=3,host"], "is not TIER=CAPACITY"),
        (["HAND", "--tiers", "device=3,disk=5,host=5"], "fastest first"),
        (["HAND", "--tiers", "device=3,host=0"], "--tiers host= '0': capacity must be > 0"),
        (["HAND", "--capacity", "3", "--tiers", "device=3"], "device capacity is given twice"),
        (["HAND", "--json", "no/such/dir/out.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(sage_kv, hand_trace, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [0]}\n{"timestamp": 1, "hash_ids": [0]}\n')
    argv = [str(hand_trace) if a == "HAND" else str(bad) if a == "BAD" else a for a in argv]
    result = sage_kv("replay", *argv)
    assert result.code == 2
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sage: error:"), result.err
    assert message in lines[0]


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"{REAL_TRACE} is not here")
def test_replays_the_head_of_the_mooncake_conversation_trace(sage_kv):
    doc = replay_json(sage_kv, REAL_TRACE, "--capacity", "5%", "--max-requests", "300", "--tiers",
                      "host=25%", "--preset", "nvidia-h100")
    assert doc["requests"] == 300
    assert doc["capacity_blocks"] == round(doc["distinct"] * 0.05)
    [lru] = doc["results"]
    assert 0 < lru["tier_hits"]["device"] and 0 < lru["tier_hits"]["host"]
    assert 0 < lru["prefix_hit_rate"] <= lru["hit_rate"] <= doc["ideal_hit_rate"]
    assert lru["prefill_seconds_saved"] > 0


def test_lower_tier_hits_do_not_count_against_the_device_only_opt():
    # one device block and a roomy host tier: the tiered run hits far more than OPT on the device alone
    requests = [TraceRequest(i * 1000, 1024, 1, [1, 2, 3] if i % 2 else [4, 5, 6]) for i in range(20)]
    document, notes = run_capacity(requests, "t", 1, ["lru"], [TierSpec("host", 100)])
    assert document["results"][0]["prefix_hit_rate"] > document["opt"]["prefix_hit_rate"]
    assert not [n for n in notes if "OPT's prefix hit rate is below" in n]
