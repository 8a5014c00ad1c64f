"""An engine with KV tiers times prefill steps of doubling size when it starts (`engine.prefill_probe`), so
load-or-compute prices a prompt's blocks with a fitted line from the first request on. The probe leaves nothing
behind: no block cached or in use, the free list as it was, nothing in the tiers; a seeded request's samples and
greedy tokens are those of an engine without tiers. Steps that cost the same at every size (a GPU running eagerly)
make a short hit computed and a long chunked one loaded."""

from __future__ import annotations

import logging

import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig
from sage_infer.engine import prefill_probe
from sage_infer.kv_policy.load_or_compute import LoadOrCompute, Rate
from tests.tiny_models import make_tiny_model

MiB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("probe") / "model", "llama")


def make_llm(model_dir, **tiers) -> LLM:
    return LLM(config=ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                                  kv_pool=KVPoolConfig(block_size=16, num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=512), tiers=TierConfig(**tiers)),
               device="cpu")


def test_an_engine_with_tiers_fits_its_step_line_before_any_request_and_leaves_no_trace(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="sage_infer.auto"):
        llm = make_llm(model_dir, host_bytes=4 * MiB)
    rates = llm.engine.load_rates
    fixed, per_work = rates.steps.line()  # 16, 32, ..., 512 tokens (the step budget), the fastest of three each
    assert fixed >= 0 and per_work >= 0 and rates.steps.observations >= 4  # (a loaded machine's line may be flat)
    assert rates.prefill.per_s > 0  # the 256- and 512-token steps
    assert [tokens for tokens, _ in rates.probed] == [16, 32, 64, 128, 256, 512]
    line = next(r.getMessage() for r in caplog.records if "prefill steps timed at start" in r.getMessage())
    assert "16 tokens" in line and "a step costs" in line
    blocks = llm.engine.kv.block_manager
    assert blocks.num_free_blocks == 64 and list(blocks.free_block_ids) == list(range(64))
    assert len(blocks.index) == 0
    blocks.check_invariants()
    assert llm.engine.kv.source("tiers").hierarchy.stores[0].stats().blocks == 0
    prompt = list(range(5, 100))
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    plain = make_llm(model_dir)
    assert plain.engine.load_rates is None
    for params in (seeded, greedy):
        [ours], [theirs] = llm.generate([prompt], params), plain.generate([prompt], params)
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_the_probe_stops_at_its_budget_and_at_what_the_free_blocks_hold(model_dir, monkeypatch):
    monkeypatch.setattr(prefill_probe, "PROBE_STEP_S", 0.0)  # every step is "long": one counted step, no repeat
    llm = make_llm(model_dir, host_bytes=4 * MiB)
    assert llm.engine.load_rates.steps.observations == 1
    monkeypatch.undo()
    engine = llm.engine
    rates = LoadOrCompute(16, engine.load_rates.block_nbytes)
    timed = prefill_probe.probe_prefill(engine.runner, engine.kv.block_manager, rates, 10_000, 512)
    assert [tokens for tokens, _ in timed] == [16, 32, 64, 128, 256, 512, 1024]  # 64 blocks hold 1,024 tokens
    assert prefill_probe.probe_prefill(engine.runner, engine.kv.block_manager, rates, 8, 512) == []


def test_steps_that_cost_the_same_at_every_size_compute_a_short_hit_and_load_a_long_chunked_one():
    # a GPU running eagerly: 16 to 2,048 tokens all take 14 ms (the H200's 0.5B shape in bf16)
    decide = LoadOrCompute(block_tokens=16, block_nbytes=196_608, chunk_tokens=2048)
    tokens = 16
    while tokens <= 2048:
        decide.observe_prefill([(tokens, 0)], 0.014)
        tokens *= 2
    assert decide.steps.line() == (pytest.approx(0.014), 0.0)
    decide.reads[1] = Rate(per_s=3.4e9)
    decide.observe_load(0.0014, 64)
    assert decide.blocks_to_load([1] * 64, 0, 1024) == 0  # one step either way: a load only adds its read
    assert not decide.worth_reading([1] * 4, 64, 0)  # a hybrid hit's blocks: all or none, none here
    # past the 2,048 tokens the steps reached, the flat line says nothing (attention over a long context is not
    # free): those blocks are priced at the average rate, and loading them pays
    assert decide.blocks_to_load([1] * 255, 0, 4096) == 255
    assert decide.blocks_to_load([1] * 1023, 0, 16384) == 1023
    decide.chunk_tokens = None  # a prompt in one step: nothing spared, the deep blocks alone pay for the load
    assert decide.blocks_to_load([1] * 127, 0, 2048) == 0
    assert decide.blocks_to_load([1] * 1023, 0, 16384) == 1023
    decide.chunk_tokens = 2048
    for tokens in [16, 256, 2048] * 10:  # steps that deep, flat as well (launches still dominate): the line covers
        decide.observe_prefill([(tokens, 16384 - tokens)], 0.014)  # them now
    assert decide.fitted_to == 16384
    assert decide.blocks_to_load([1] * 255, 0, 4096) == 128  # 2 steps -> 1: loading more only adds reads
    assert decide.blocks_to_load([1] * 1023, 0, 16384) == 7 * 128  # 8 steps -> 1


def test_the_start_up_line_says_what_was_timed_and_what_was_fitted():
    rates = LoadOrCompute(16, MiB)
    assert "none (the free blocks or the context hold fewer than 16 tokens)" in prefill_probe.describe(rates)
    rates.observe_prefill([(16, 0)], 0.3)
    rates.probed = ((16, 0.3),)
    assert "16 tokens 300.0 ms; too few sizes for a line yet" in prefill_probe.describe(rates)
    for tokens in (32, 64, 128):
        rates.observe_prefill([(tokens, 0)], 0.3)
    assert prefill_probe.describe(rates).endswith("a step costs 300.00 ms whatever its size")


def test_a_cold_step_far_slower_than_the_one_before_runs_again_and_its_warm_time_counts(monkeypatch):
    # the H200: 16 tokens 28.5 ms, then 713 ms for 32 (a kernel compiled for the new size); counted, that one step
    # ended the probe and set the line's fixed part to 117 ms
    calls: list[int] = []

    def step(runner, blocks, token_ids):
        calls.append(len(token_ids))
        cold = len(token_ids) == 32 and calls.count(32) == 1
        return 0.713 if cold else 0.028

    monkeypatch.setattr(prefill_probe, "_step", step)
    rates = LoadOrCompute(16, MiB)
    timed = prefill_probe.probe_prefill(None, None, rates, 128, 512)
    assert timed == [(16, 0.028), (32, 0.028), (64, 0.028), (128, 0.028)]
    assert calls == [16] + [16] * 3 + [32] * 4 + [64] * 3 + [128] * 3  # warm-up, then three each (+1 for cold 32)
    assert rates.steps.line() == (pytest.approx(0.028), 0.0)
    calls.clear()  # twice the time for twice the work is not cold: no extra run (128 tokens: long, once)
    monkeypatch.setattr(prefill_probe, "_step", lambda runner, blocks, ids: calls.append(len(ids)) or len(ids) * 1e-3)
    timed = prefill_probe.probe_prefill(None, None, LoadOrCompute(16, MiB), 128, 512)
    assert [t for t, _ in timed] == [16, 32, 64, 128] and calls == [16] + [16] * 3 + [32] * 3 + [64] * 3 + [128]
