"""Load a lower-tier hit, or compute it again: decided per request from the measured prefill and read speeds.
Unit cases of the decision (a block priced by its position when the model's shape is known), the read speed a real
host tier shows at start-up, then a real engine with a host tier whose measured reads are slower (then faster) than
its measured prefill: the evicted prompt is computed (then loaded), its tokens the same either way."""

from __future__ import annotations

import copy

import pytest

from sage_infer.kv_policy.cost_benefit import ModelShape
from sage_infer.kv_policy.load_or_compute import LoadOrCompute, Rate, StepFit
from tests.test_kv_tiers_engine import BLOCK, A, B, C, cold, make_llm, model_dir, run  # noqa: F401 - fixtures

MiB = 1 << 20


def rates(prefill_tok_s: float, **read_mib_s: float) -> LoadOrCompute:
    """A block of 16 tokens and 1 MiB; `read_mib_s`: level1=..., level2=... in MiB/s."""
    decide = LoadOrCompute(block_tokens=16, block_nbytes=MiB)
    decide.observe_prefill([(int(prefill_tok_s), 0)], 1.0)
    for name, mib_s in read_mib_s.items():
        decide.observe_read(int(name.removeprefix("level")), int(mib_s * MiB), 1.0)
    return decide


def test_blocks_are_loaded_until_both_speeds_are_measured():
    assert LoadOrCompute(16, MiB).blocks_to_load([1, 2, 3]) == 3
    assert rates(16_000).blocks_to_load([1, 1]) == 2  # the tier's reads not measured yet
    assert rates(16_000, level1=1).blocks_to_load([]) == 0


def test_the_leading_run_that_saves_time_is_loaded_and_the_rest_computed():
    # a block computes in 1 ms at 16k tok/s; it loads in 0.1 ms at 10 GiB/s (host) or 10 ms at 100 MiB/s (disk)
    decide = rates(16_000, level1=10_240, level2=100)
    assert decide.blocks_to_load([1, 1, 1]) == 3
    assert decide.blocks_to_load([2, 2]) == 0  # recomputing is 10 x faster than reading the disk
    assert decide.blocks_to_load([1, 1, 2, 2]) == 2  # the host's blocks, then compute
    # a slow block between fast ones is loaded when the run after it pays for it
    assert rates(16_000, level1=10_240, level2=900).blocks_to_load([1, 2] + [1] * 8) == 10
    assert rates(16_000, level1=10_240, level2=10).blocks_to_load([1, 2] + [1] * 8) == 1


def test_a_step_below_the_minimum_prompt_tokens_is_not_a_prefill_rate():
    decide = LoadOrCompute(16, MiB)
    decide.observe_prefill([(100, 0), (100, 50)], 1.0)  # 200 tokens: mostly the step's overheads
    assert decide.prefill.per_s is None
    decide.observe_prefill([(200, 0), (100, 50)], 1.0)
    assert decide.prefill.per_s == 300


def test_a_step_s_fixed_part_is_fitted_and_not_counted_as_what_loading_saves():
    """Launch-bound steps (the H200's eager prefill: ~14 ms for 16 tokens, ~16 for 256): loading a short prompt
    saves only the marginal part of a step, less than its read and the load's own cost, so it is computed."""
    decide = LoadOrCompute(block_tokens=16, block_nbytes=196_608, chunk_tokens=2048)
    for tokens, seconds in [(16, 0.0140), (256, 0.0160), (1024, 0.0224), (2048, 0.0310), (16, 0.0141), (512, 0.0181)]:
        decide.observe_prefill([(tokens, 0)], seconds)
    fixed, per_token = decide.steps.line()
    assert fixed == pytest.approx(0.0139, abs=2e-4) and per_token == pytest.approx(8.3e-6, rel=0.03)
    assert decide.prefill_s(240, 0) == pytest.approx(240 * per_token)  # not 240 tokens at the average rate
    assert decide.prefill_s(240, 0) < 0.3 * 240 / decide.prefill.per_s  # the average rate: 7.9 ms
    decide.observe_read(1, 15 * 196_608, 0.0013)  # 15 blocks in 1.3 ms
    assert decide.blocks_to_load([1] * 15, 0, 256) == 15  # 2.0 ms of compute saved for a 1.3 ms read
    decide.observe_load(0.002, 15)  # a load's own engine time: 2 ms
    assert decide.load_cost() == (0.002, 0.0)  # one size seen: a fixed cost
    assert decide.blocks_to_load([1] * 15, 0, 256) == 0  # 0.7 ms saved does not pay for it
    assert not decide.worth_reading([1] * 15, 240, 0)
    # loads of several sizes: a fixed part and a part per block
    for blocks, seconds in [(15, 0.002), (255, 0.006), (1023, 0.018), (63, 0.003)]:
        decide.observe_load(seconds, blocks)
    fixed, per_block = decide.load_cost()
    assert 0.001 < fixed < 0.003 and per_block == pytest.approx(1.6e-5, rel=0.2)
    assert decide.steps_spared(16_384, 1023 * 16) == 7 and decide.steps_spared(256, 240) == 0
    assert decide.blocks_to_load([1] * 1023, 0, 16_384) == 1023
    assert decide.blocks_to_load([1] * 15, 0, 256) == 0
    # a 16K prompt (8 steps of 2,048 tokens) from a slower tier: its blocks' marginal compute (136 ms) is less than
    # their read (130 ms) and the load's work (16 ms), but loading spares 7 steps' fixed part (97 ms); the blocks past
    # the 7th step's end spare none, so the last 2,048 tokens are computed, in the one step left either way
    decide.observe_read(2, 1023 * 196_608, 0.130)
    decide.observe_prefill([(2048, 14_336)], 0.031)  # a step that deep: the line now prices blocks that far in
    assert decide.blocks_to_load([2] * 1023, 0, 16_384) == 896
    decide.chunk_tokens = None  # one step either way: it does not pay
    assert decide.blocks_to_load([2] * 1023, 0, 16_384) == 0


def test_a_step_with_decode_rows_is_not_a_point_of_the_line():
    decide = LoadOrCompute(block_tokens=16, block_nbytes=MiB)
    decide.observe_prefill([(512, 0)], 0.05, only_prefill=False)
    assert decide.steps.observations == 0 and decide.prefill.per_s == 512 / 0.05


def test_steps_of_one_size_tell_no_slope_and_the_average_rate_prices_a_block():
    decide = LoadOrCompute(block_tokens=16, block_nbytes=MiB)
    for _ in range(10):
        decide.observe_prefill([(2048, 0)], 0.1)
    assert decide.steps.line() is None
    assert decide.prefill_s(16, 0) == pytest.approx(16 / 20_480)


def test_with_a_model_shape_a_block_costs_what_its_position_costs():
    shape = ModelShape(num_layers=6, hidden=384, num_kv_heads=2, head_dim=64, dtype_bytes=4, num_params=11e6)
    decide = LoadOrCompute(block_tokens=16, block_nbytes=96 * 1024, shape=shape)
    decide.observe_prefill([(2048, 6144)], 1.0)  # a chunk deep in a long prompt, in one second
    assert decide.prefill.per_s == pytest.approx(shape.prefill_flops(2048, 6144))
    deep = decide.prefill_s(16, 16_000)
    assert deep > 5 * decide.prefill_s(16, 0)  # attention over 16K earlier tokens dominates the block
    # a tier that reads a block in about what a block at position 2K computes in
    decide.reads[1] = Rate(per_s=96 * 1024 / decide.prefill_s(16, 2048))
    assert decide.blocks_to_load([1] * 64) == 0  # a short prompt's blocks: computing them is faster
    assert decide.blocks_to_load([1] * 64, first_block=1000) == 64  # deep in a long prompt: loading is
    # a long prompt whose leading blocks are all below: its early blocks lose, the later ones win it back
    assert decide.blocks_to_load([1] * 1024) == 1024


def test_each_tier_read_speed_is_measured_when_the_engine_starts(model_dir):  # noqa: F811
    llm = make_llm(model_dir, host_bytes=1 << 20)
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    assert hierarchy.rates.reads[1].per_s > 0 and hierarchy.rates.shape is not None
    assert hierarchy.stores[0].stats().blocks == 0  # the probe's blocks are gone again


def test_a_tier_slower_than_recomputing_is_not_loaded_and_the_tokens_are_the_same(model_dir, cold):  # noqa: F811
    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    assert hierarchy.rates is llm.engine.load_rates
    nbytes = hierarchy.pool.block_nbytes
    hierarchy.rates.steps = StepFit()  # no line fitted (the engine's start fitted one): this rate prices a block
    hierarchy.rates.prefill = Rate(per_s=hierarchy.rates.work(BLOCK, 0) * 1000)  # about 1 ms a block
    hierarchy.rates.reads[1] = Rate(per_s=nbytes / 0.1)  # 100 ms a block from the host tier: a slow tier
    assert run(llm, A) == (cold, 0)  # computed again
    assert hierarchy.stats.failures["recompute"] == 5 and hierarchy.stats.tiers["host"].loaded_blocks == 0
    for tokens in (B, C):  # A goes back down
        run(llm, tokens)
    for _ in range(40):  # now the host reads at 100 x the prefill's pace
        hierarchy.rates.observe_read(1, 1000 * nbytes, 0.01)
    assert run(llm, A) == (cold, 5 * BLOCK)  # loaded
    assert hierarchy.stats.tiers["host"].loaded_blocks == 5
    llm.engine.kv.block_manager.check_invariants()


def test_a_step_far_slower_than_the_line_is_left_out_unless_such_steps_keep_coming():
    decide = LoadOrCompute(block_tokens=16, block_nbytes=MiB)
    for tokens in (16, 32, 64, 128, 256, 512):
        decide.observe_prefill([(tokens, 0)], 0.010 + tokens * 1e-5)
    line = decide.steps.line()
    assert line == (pytest.approx(0.010), pytest.approx(1e-5))
    rate = decide.prefill.per_s
    decide.observe_prefill([(256, 0)], 0.393)  # a cold first request (a GPU compiled a kernel for its shape)
    assert decide.steps.line() == line and decide.prefill.per_s == rate and decide.steps.outliers == 1
    probe = LoadOrCompute(block_tokens=16, block_nbytes=MiB)
    probe.steps, probe.prefill = copy.deepcopy(decide.steps), Rate(rate, 1)
    probe.observe_prefill([(256, 0)], 0.393, screen=False)  # timed on purpose (the start-up probe): always fitted
    assert probe.steps.observations == decide.steps.observations + 1 and probe.steps.outliers == 1
    decide.observe_prefill([(256, 0)], 0.020)  # an ordinary step is fitted, and ends the run of outliers
    assert decide.steps.observations == 7
    for _ in range(3):  # the machine got slower for good: after three outliers in a row the line follows
        decide.observe_prefill([(256, 0)], 0.2)
    assert decide.steps.outliers == 4 and decide.steps.observations == 7
    decide.observe_prefill([(256, 0)], 0.2)
    assert decide.steps.observations == 8 and decide.steps.line()[0] > line[0]
    # a load's cost: one 15 times slower than those before is left out too
    decide.observe_load(0.002, 8)
    decide.observe_load(0.030, 8)
    assert decide.load_s == 0.002 and decide.loads.outliers == 1  # no line yet (one size): its average decides


def test_a_hit_expected_to_lose_less_than_a_millisecond_is_kept_and_one_that_loses_more_is_computed():
    decide = rates(16_000, level1=1 / 1.05e-3)  # a block computes in 1 ms and reads in 1.05 ms
    assert decide.blocks_to_load([1] * 4) == 4  # 0.2 ms worse by the estimates: noise, the hit is kept
    assert decide.blocks_to_load([1] * 40) == 0  # 2 ms worse: computed
    assert decide.worth_reading([1] * 4, 64, 0) and not decide.worth_reading([1] * 40, 640, 0)
