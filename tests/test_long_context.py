"""bench/long_context.py at a small scale: a 4K-context random model, ~4K / ~2K / short prompts
through a device pool smaller than the demand, host and disk tiers below it. Every request
finishes, the pool holds real tokens (>= 90 % of its allocated slots), the tiers take blocks
and give them back, and greedy tokens do not change with the tiers."""

from __future__ import annotations

import pytest

from bench.long_context import Livelock, Settings, build_workload, goals, model_shape, run_workload
from tests.tiny_models import make_tiny_model


def quiet(*args, **kwargs) -> None:
    pass


SMALL = Settings(context=4096, block_size=16, budget=256, max_num_seqs=8, num_short=12, short_max=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("long-ctx") / "model", "llama", vocab_size=SMALL.vocab,
                           **model_shape(SMALL))


@pytest.fixture(scope="module")
def reqs():
    return build_workload(SMALL)


@pytest.fixture(scope="module")
def tiered(model_dir, reqs, tmp_path_factory):
    return run_workload(model_dir, SMALL, reqs, tiers=True, work=tmp_path_factory.mktemp("work"), log=quiet)


@pytest.fixture(scope="module")
def device_only(model_dir, reqs, tmp_path_factory):
    return run_workload(model_dir, SMALL, reqs, tiers=False, work=tmp_path_factory.mktemp("work"), log=quiet)


def test_the_workload_overflows_the_device_pool(tiered, reqs):
    assert tiered["demand_blocks"] > 3 * tiered["pool_blocks"]
    assert max(len(r.tokens) for r in reqs) > SMALL.context - 64
    assert tiered["preemptions"] > 0


def test_every_request_finishes_with_its_tokens(tiered, reqs):
    assert set(tiered["requests"]) == {r.name for r in reqs}
    for r in reqs:
        out = tiered["requests"][r.name]
        assert out["error"] is None and out["finish_reason"] == "length"
        assert len(out["tokens"]) == r.max_tokens


def test_the_pool_is_filled_with_tokens(tiered):
    util = tiered["utilization"]
    assert util["steps"] > 50
    assert util["min"] >= 0.90
    assert tiered["block_count_mismatches"] == 0


def test_tiers_take_evicted_blocks_and_give_them_back(tiered):
    tiers = {t["tier"]: t for t in tiered["tier_stats"]}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"]["demoted"] > 0 and tiers["disk"]["demoted"] > 0
    assert tiers["host"]["loaded"] + tiers["disk"]["loaded"] > 0
    assert tiered["tier_load_failures"] == 0 and all(t["errors"] == 0 for t in tiers.values())
    # the repeats' prefixes left the device long before they arrived: their hits came from below
    bs = SMALL.block_size
    rep_half = tiered["requests"]["rep-half-0"]
    assert rep_half["cached_tokens"] == (rep_half["prompt_tokens"] - 1) // bs * bs
    rep_full = tiered["requests"]["rep-full-0"]
    assert rep_full["cached_tokens"] >= 3 * rep_full["prompt_tokens"] // 4 - bs


def test_greedy_tokens_are_the_same_with_and_without_tiers(tiered, device_only, reqs):
    assert sum(t["loaded"] for t in device_only["tier_stats"]) == 0
    assert device_only["requests"]["rep-half-0"]["cached_tokens"] == 0  # recomputed without tiers
    for r in reqs:
        assert tiered["requests"][r.name]["tokens"] == device_only["requests"][r.name]["tokens"], r.name
    assert tiered["requests"]["rep-half-0"]["tokens"] == tiered["requests"]["half-0"]["tokens"]


def test_the_bench_goals_are_met(tiered, device_only, reqs):
    failed = [g for g in goals(tiered, reqs, device_only) if not g["met"]]
    assert not failed


def test_the_step_guard_fails_loudly(model_dir, reqs, tmp_path):
    tight = Settings(**{**SMALL.__dict__, "max_steps": 20})
    with pytest.raises(Livelock, match="unfinished"):
        run_workload(model_dir, tight, reqs, tiers=False, work=tmp_path, log=quiet)
