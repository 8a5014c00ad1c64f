"""KV retention of stored conversations (`kv_runtime.retention`, `engine.session_kv`) on a real engine with a small
device pool: a retained conversation's blocks outlive traffic that evicts everything else, and retention never keeps
a request from running (its blocks go last, but they go)."""

from __future__ import annotations

import random

import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.backends.offline import llm_config
from sage_infer.config.serve import TierConfig
from sage_infer.kv_runtime.retention import KVRetention
from tests.tiny_models import make_tiny_model

BLOCK = 16
NUM_BLOCKS = 24
GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("retention") / "model", "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=NUM_BLOCKS, block_size=BLOCK)
    assert llm.engine.sessions.enable(0.5)
    return llm


@pytest.fixture
def llm(engine):
    """The module's engine with an empty cache and no retention, checked for leaks afterwards."""
    manager = engine.engine.kv.block_manager
    engine.engine.sessions.release("c")
    manager.reset_prefix_cache()
    yield engine
    manager.check_invariants()
    assert manager.get_utilization() == 0.0, "a test leaked in-use blocks"


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def first_turn(llm: LLM, retain: bool) -> list[int]:
    """A 64-token prompt and its 9 tokens, the context (4 full blocks) retained as conversation ``c`` when asked;
    the next turn's prompt (that context plus 20 new tokens)."""
    prompt = ids(64, seed=1)
    out = llm.generate([prompt], GREEDY)[0]
    context = prompt + out.outputs[0].token_ids
    if retain:
        assert llm.engine.sessions.retain("c", context[:-1], None, ttl_s=60) == 4
    return context + ids(20, seed=2)


def flood(llm: LLM) -> None:
    """Other traffic: 6 prompts of 5 blocks each, 30 blocks through a 24-block pool."""
    llm.generate([ids(80, seed) for seed in range(10, 16)], SamplingParams(max_tokens=1, temperature=0))


def test_a_retained_conversation_is_a_prefix_hit_after_traffic_that_evicts_everything_else(llm):
    second = first_turn(llm, retain=True)
    flood(llm)
    out = llm.generate([second], GREEDY)[0]
    assert out.metrics.num_cached_tokens >= 64  # the whole first turn's context, from the device
    assert llm.engine.sessions.stats()["retained_evicted_under_pressure"] == 0
    assert llm.engine.kv.block_manager.retention.num_blocks == 4


def test_without_retention_the_same_traffic_evicts_the_conversation(llm):
    second = first_turn(llm, retain=False)
    flood(llm)
    assert llm.generate([second], GREEDY)[0].metrics.num_cached_tokens == 0


def test_a_released_conversation_is_evicted_like_any_other_block(llm):
    second = first_turn(llm, retain=True)
    assert llm.engine.sessions.release("c")
    flood(llm)
    assert llm.generate([second], GREEDY)[0].metrics.num_cached_tokens == 0


def test_retention_cannot_starve_a_request_that_needs_the_whole_pool(llm):
    first_turn(llm, retain=True)
    big = ids(NUM_BLOCKS * BLOCK - 12, seed=99)  # every block of the pool, the retained ones included
    out = llm.generate([big], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    stats = llm.engine.sessions.stats()
    assert stats["retained_evicted_under_pressure"] >= 1


def test_retention_is_bounded_and_ends_with_its_ttl():
    now = [0.0]
    retention = KVRetention(max_blocks=4, clock=lambda: now[0])
    a, b = [bytes([1, i]) for i in range(3)], [bytes([2, i]) for i in range(3)]
    assert retention.retain("a", a, ttl_s=10) == 3
    assert retention.retain("b", b, ttl_s=20) == 3  # past 4 blocks: the oldest retention ends
    assert not retention.holds(a[0]) and retention.holds(b[0]) and retention.dropped == 1
    assert retention.retain("long", [bytes([3, i]) for i in range(9)], ttl_s=20) == 4  # its first 4 blocks
    now[0] = 25.0
    assert retention.expire() == 1 and retention.num_blocks == 0


def test_retained_blocks_pushed_to_the_host_tier_stay_there_while_other_blocks_go(model_dir, engine):
    config = llm_config(str(model_dir), dtype="fp32", num_blocks=NUM_BLOCKS, block_size=BLOCK)
    host = TierConfig(host_bytes=8 * engine.engine.runner.pool.block_nbytes)  # 8 blocks
    llm = LLM(config=config.model_copy(update={"tiers": host}))
    assert llm.engine.sessions.enable(0.5)
    second = first_turn(llm, retain=True)
    # a prompt needing every device block: the retained ones go last, demoted to the 8-block host tier
    llm.generate([ids(NUM_BLOCKS * BLOCK - 12, seed=99)], SamplingParams(max_tokens=4, temperature=0))
    flood(llm)  # 30 blocks of other traffic demoted through the host tier: they, not the retained ones, leave it
    out = llm.generate([second], GREEDY)[0]
    assert out.metrics.num_cached_tokens >= 64
    assert llm.engine.stats().prefix_lower_hit_tokens >= 64  # loaded back from the host tier
