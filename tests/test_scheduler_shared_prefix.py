"""Requests that arrive together behind one shared prefix compute it once: the first step admits all of them, the
first computes the prefix and the others take its blocks as computed in that same step (`KVCacheManager.admit`'s
`borrowed`; the step stores each layer's K/V before any row attends). Where they cannot (the first computes only
part of the prefix this step, a model with KV groups), the others wait a step (`Scheduler.deferred`) and then find
the prefix cached. Outputs equal those of each request served alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.core.outputs import RequestOutput
from sage_infer.server.metrics import ServerMetrics
from tests.tiny_models import make_tiny_model

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("shared") / "m", "llama")


def prompts(prefix_blocks: int = 4, n: int = 6) -> list[list[int]]:
    shared = [5 + (3 * i) % 400 for i in range(prefix_blocks * BLOCK)]
    return [shared + [100 + 7 * j + i for i in range(10 + 3 * j)] for j in range(n)]


def scraped(llm: LLM) -> dict[str, float]:
    """The engine's counters as `/metrics` renders them, parsed back with prometheus_client."""
    metrics = ServerMetrics(SimpleNamespace(stats=llm.engine.stats), "tiny")
    text = generate_latest(metrics.registry).decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def finished(llm: LLM) -> dict[str, RequestOutput]:
    """Step the engine until every request ended: each one's final output, by request id."""
    outputs = {}
    while llm.engine.has_unfinished_requests():
        outputs.update({out.request_id: out for out in llm.engine.step() if out.finished})
    return outputs


def served_alone(tiny, batch: list[list[int]]) -> list[list[int]]:
    alone = LLM(str(tiny), dtype="fp32", num_blocks=128, enable_prefix_caching=False)
    return [alone.generate([p], GREEDY)[0].outputs[0].token_ids for p in batch]


@pytest.mark.parametrize("prefill", ["auto", "torch"])
@pytest.mark.parametrize("cascade", [False, True])
def test_a_batch_behind_one_new_prefix_computes_it_once_in_one_step(tiny, prefill, cascade):
    config = ServeConfig.model_validate({"model": {"path": str(tiny), "dtype": "fp32", "prefill_attention": prefill,
                                                   "cascade_attention": cascade}, "kv_pool": {"num_blocks": 128}})
    llm = LLM(config=config)
    llm.engine.runner.cascade_min_saved_tokens = 1  # the borrowers attend the new prefix together in that step
    for i, p in enumerate(prompts()):
        llm.engine.add_request(f"r{i}", p, GREEDY)
    llm.engine.step()  # one step: the prefix once, every prompt's own tail, every first token
    scheduler, kv = llm.engine.scheduler, llm.engine.kv
    assert scheduler.deferred == 0 and scheduler.num_running == 6
    assert kv.in_step_tokens == 5 * 4 * BLOCK
    assert scraped(llm)["sage:prefix_cache_same_step_hits_total"] == 5 * 4 * BLOCK
    assert llm.engine.runner.cascade_steps == int(cascade)
    tables = [seq.block_table[:4] for seq in scheduler.running]
    assert all(table == tables[0] for table in tables)  # the same four blocks, not copies
    outputs = finished(llm)
    assert [outputs[f"r{i}"].metrics.num_cached_tokens for i in range(6)] == [0] + [4 * BLOCK] * 5
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(6)] == served_alone(tiny, prompts())
    kv.block_manager.check_invariants()
    assert kv.block_manager.num_available_blocks == kv.block_manager.num_blocks  # every reference returned


def test_an_abort_of_the_request_that_computed_the_prefix_leaves_the_others_whole(tiny):
    llm = LLM(str(tiny), dtype="fp32", num_blocks=128)
    batch = prompts(n=3)
    for i, p in enumerate(batch):
        llm.engine.add_request(f"r{i}", p, GREEDY)
    llm.engine.step()
    llm.engine.abort_request("r0")
    outputs = finished(llm)
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in (1, 2)] == served_alone(tiny, batch[1:])
    llm.engine.kv.block_manager.check_invariants()


def test_a_prefix_computed_over_several_steps_makes_the_others_wait(tiny):
    """The first request's chunk covers only part of the prefix: the others wait (taking the part computed so far
    would leave them to compute the rest a second time), then find that part cached and take the rest as the
    first computes it in the next step."""
    llm = LLM(str(tiny), dtype="fp32", num_blocks=128, long_prefill_token_threshold=2 * BLOCK)
    for i, p in enumerate(prompts(n=3)):
        llm.engine.add_request(f"r{i}", p, GREEDY)
    llm.engine.step()
    assert llm.engine.scheduler.deferred == 2 and llm.engine.scheduler.num_running == 1
    assert llm.engine.kv.in_step_tokens == 0
    done = finished(llm)
    outputs = [done[f"r{i}"] for i in range(3)]
    assert llm.engine.kv.in_step_tokens == 2 * 2 * BLOCK  # blocks 2 and 3, by r1 and r2 in the second step
    assert [o.metrics.num_cached_tokens for o in outputs] == [0, 4 * BLOCK, 4 * BLOCK]
    assert [o.outputs[0].token_ids for o in outputs] == served_alone(tiny, prompts(n=3))
    llm.engine.kv.block_manager.check_invariants()


def test_different_salts_or_no_prefix_cache_share_nothing(tiny):
    llm = LLM(str(tiny), dtype="fp32", num_blocks=128)
    for i, p in enumerate(prompts(n=3)):  # one step: different tenants never share blocks
        llm.engine.add_request(f"r{i}", p, GREEDY, cache_salt=f"tenant-{i}")
    llm.engine.step()
    assert llm.engine.scheduler.deferred == 0 and llm.engine.scheduler.num_running == 3
    assert llm.engine.kv.in_step_tokens == 0
    assert len({block for seq in llm.engine.scheduler.running for block in seq.block_table}) == \
        sum(len(seq.block_table) for seq in llm.engine.scheduler.running)
    plain = LLM(str(tiny), dtype="fp32", num_blocks=128, enable_prefix_caching=False)
    plain.generate(prompts(n=3), GREEDY)
    assert plain.engine.scheduler.deferred == 0 and plain.engine.kv.in_step_tokens == 0
