"""Requests that arrive together behind one shared prefix compute it once: the first step admits one of
them, the others wait a step (`Scheduler.deferred`) and then find the prefix cached. Outputs equal those
of each request served alone."""

from __future__ import annotations

import pytest

from sage_infer import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("shared") / "m", "llama")


def prompts(prefix_blocks: int = 4, n: int = 6) -> list[list[int]]:
    shared = [5 + (3 * i) % 400 for i in range(prefix_blocks * BLOCK)]
    return [shared + [100 + 7 * j + i for i in range(10)] for j in range(n)]


def test_a_batch_behind_one_prefix_computes_it_once(tiny):
    llm = LLM(str(tiny), dtype="fp32", num_blocks=128)
    outputs = llm.generate(prompts(), GREEDY)
    assert outputs[0].metrics.num_cached_tokens == 0
    assert [o.metrics.num_cached_tokens for o in outputs[1:]] == [4 * BLOCK] * 5  # every other one reused it
    assert llm.engine.scheduler.deferred >= 5
    alone = LLM(str(tiny), dtype="fp32", num_blocks=128, enable_prefix_caching=False)
    want = [alone.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts()]
    assert [o.outputs[0].token_ids for o in outputs] == want
    llm.engine.kv.block_manager.check_invariants()


def test_different_salts_or_no_prefix_cache_are_not_deferred(tiny):
    llm = LLM(str(tiny), dtype="fp32", num_blocks=128)
    for i, p in enumerate(prompts(n=3)):  # one step: different tenants never share blocks
        llm.engine.add_request(f"r{i}", p, GREEDY, cache_salt=f"tenant-{i}")
    llm.engine.step()
    assert llm.engine.scheduler.deferred == 0 and llm.engine.scheduler.num_running == 3
    plain = LLM(str(tiny), dtype="fp32", num_blocks=128, enable_prefix_caching=False)
    plain.generate(prompts(n=3), GREEDY)
    assert plain.engine.scheduler.deferred == 0
