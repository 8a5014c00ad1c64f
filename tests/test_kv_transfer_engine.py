"""Prefill/decode separation at the engine level: a prefill engine computes the prompt and holds its
KV, a decode engine receives the blocks over a real transport (shm and tcp loopback) and continues.

Greedy output is token-identical to one engine doing both; the decode engine's prompt KV is a
prefix hit registered under the same chained hashes; the prefill engine frees the blocks once the
receiver verified them; a transfer that never comes costs a recompute; nothing leaks.
"""

from __future__ import annotations

import time

import pytest
import torch

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import KVPoolConfig, ModelConfig, ServeConfig
from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.messages import AddRequest, KVTransferParams
from sage_infer.engine.llm_engine import LLMEngine, RequestError
from tests.tiny_models import make_tiny_model

BLOCK = 16
PROMPT = [5 + (7 * j) % 300 for j in range(5 * BLOCK + 3)]  # 5 full blocks and 3 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pd") / "model", "llama")


def make_llm(model_dir, kv_dtype: str = "auto", speculative: dict | None = None, role: str = "both",
             **transport) -> LLM:
    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                         kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=32, kv_dtype=kv_dtype),
                         speculative=speculative or {}, role=role, kv_transport=KVTransportConfig(**transport))
    return LLM(config=config, device="cpu")


def pair(model_dir, **kwargs) -> tuple[LLMEngine, LLMEngine, str]:
    """A prefill engine, a decode engine, and the address the decode engine receives at."""
    prefill = make_llm(model_dir, role="prefill", **kwargs).engine
    decode = make_llm(model_dir, role="decode", **kwargs).engine
    return prefill, decode, decode.pd.info().address


def run_until(engine: LLMEngine, done, timeout: float = 20.0) -> list:
    outputs, deadline = [], time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        outputs += engine.step()
    return outputs


def hand_off(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams):
    """`prompt` prefilled on `prefill` (its KV held), sent to `decode`, which continues it with `params`; both run
    until idle. Returns the decode engine's finished output and how many blocks the send moved."""
    digest = prefill.kv_schema_digest
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill.add(AddRequest("r1", prompt, first, kv_transfer=KVTransferParams(hold=True, schema_digest=digest)))
    run_until(prefill, lambda: not prefill.scheduler.has_unfinished())
    decode.add(AddRequest("r1", prompt, params, kv_transfer=KVTransferParams(transfer_id="t-r1",
                                                                             schema_digest=digest)))
    sent = prefill.pd.send("r1", decode.pd.info().address, "t-r1")
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    run_until(prefill, lambda: not prefill.has_unfinished_requests())
    return final, sent


@pytest.fixture(scope="module")
def colocated(model_dir):
    [out] = make_llm(model_dir).generate([PROMPT], GREEDY)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_decode_continues_from_the_prefill_engines_kv_token_for_token(model_dir, colocated, backend):
    prefill, decode, address = pair(model_dir, backend=backend)
    digest = prefill.kv_schema_digest

    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill.add(AddRequest("r1", PROMPT, first, kv_transfer=KVTransferParams(hold=True, schema_digest=digest)))
    [out] = [o for o in run_until(prefill, lambda: not prefill.scheduler.has_unfinished()) if o.finished]
    assert out.outputs[0].token_ids == colocated[:1]
    sent = prefill.kv.source("transfers").transfers
    assert "r1" in sent.held  # finished, but its blocks are kept for the decode engine

    decode.add(AddRequest("r1", PROMPT, GREEDY, kv_transfer=KVTransferParams(transfer_id="t-r1",
                                                                             schema_digest=digest)))
    assert prefill.pd.send("r1", address, "t-r1") == 5
    outputs = run_until(decode, lambda: not decode.has_unfinished_requests())
    [final] = [o for o in outputs if o.finished]
    assert final.outputs[0].token_ids == colocated
    assert final.metrics.num_cached_tokens == 5 * BLOCK  # every full prompt block came over the wire
    run_until(prefill, lambda: not prefill.has_unfinished_requests())  # the send was acknowledged: freed
    assert sent.stats.sent == 1 and not sent.held
    assert prefill.kv.block_manager.num_used_blocks == 0
    assert decode.kv.source("transfers").transfers.stats.received == 1

    # the received blocks are registered like computed ones: the next request with this prefix hits them
    decode.add(AddRequest("r2", PROMPT, GREEDY))
    [second] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    assert second.outputs[0].token_ids == colocated and second.metrics.num_cached_tokens == 5 * BLOCK
    for engine in (prefill, decode):
        engine.kv.block_manager.check_invariants()
        engine.shutdown()


def test_a_decode_engine_with_speculation_verifies_over_received_kv_and_samples_the_same_tokens(model_dir):
    """The prompt is the model's own greedy text, so the sampled continuation repeats it and prompt lookup
    proposes; a seeded request samples the same tokens as a colocated engine without speculation."""
    start = PROMPT[:3]
    greedy = make_llm(model_dir).generate([start], SamplingParams(max_tokens=5 * BLOCK, temperature=0,
                                                                  ignore_eos=True))
    prompt = start + greedy[0].outputs[0].token_ids  # 5 full blocks and 3 tokens, as PROMPT
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_k=3, seed=7, ignore_eos=True)
    [reference] = make_llm(model_dir).generate([prompt], sampled)
    prefill = make_llm(model_dir, role="prefill").engine
    decode = make_llm(model_dir, speculative={"method": "ngram", "prompt_lookup_min": 1}, role="decode").engine
    final, sent = hand_off(prefill, decode, prompt, sampled)
    assert sent == 5
    assert final.outputs[0].token_ids == reference.outputs[0].token_ids
    assert final.metrics.num_cached_tokens == 5 * BLOCK
    assert decode.spec_stats.num_accepted_tokens > 0
    for engine in (prefill, decode):
        engine.kv.block_manager.check_invariants()
        assert engine.kv.block_manager.num_used_blocks == 0
        engine.shutdown()


def test_a_transfer_that_never_comes_costs_a_recompute_not_a_wrong_token(model_dir, colocated):
    decode = make_llm(model_dir, role="decode", timeout_s=0.3).engine  # the transfer's deadline
    decode.add(AddRequest("r1", PROMPT, GREEDY, kv_transfer=KVTransferParams(transfer_id="never")))
    outputs = run_until(decode, lambda: not decode.has_unfinished_requests())
    [final] = [o for o in outputs if o.finished]
    assert final.outputs[0].token_ids == colocated and final.metrics.num_cached_tokens == 0
    assert decode.kv.source("transfers").transfers.stats.receive_failures == 1
    decode.kv.block_manager.check_invariants()
    decode.shutdown()


def test_held_kv_nobody_takes_is_freed_when_the_hold_expires(model_dir):
    prefill = make_llm(model_dir, role="prefill", timeout_s=0.2).engine  # how long KV is held
    prefill.add(AddRequest("r1", PROMPT, SamplingParams(max_tokens=1, temperature=0),
                           kv_transfer=KVTransferParams(hold=True)))
    run_until(prefill, lambda: not prefill.has_unfinished_requests())
    assert prefill.kv.source("transfers").transfers.stats.expired_holds == 1
    assert prefill.kv.block_manager.num_used_blocks == 0
    with pytest.raises(RequestError, match="no KV is held"):
        prefill.pd.send("r1", "shm:///nowhere", "t")
    prefill.kv.block_manager.check_invariants()
    prefill.shutdown()


def test_a_schema_mismatch_or_an_engine_without_a_role_is_refused(model_dir):
    plain = make_llm(model_dir).engine
    with pytest.raises(RequestError, match="does not transfer KV"):
        plain.add(AddRequest("r1", PROMPT, GREEDY, kv_transfer=KVTransferParams(hold=True)))
    decode = make_llm(model_dir, role="decode").engine
    with pytest.raises(RequestError, match="KV schema"):
        decode.add(AddRequest("r1", PROMPT, GREEDY, kv_transfer=KVTransferParams(transfer_id="t",
                                                                                 schema_digest="00" * 16)))
    with pytest.raises(RequestError, match="n=1"):
        decode.add(AddRequest("r2", PROMPT, SamplingParams(n=2), kv_transfer=KVTransferParams(hold=True)))
    assert not decode.has_unfinished_requests()
    decode.shutdown()


@pytest.mark.parametrize("same_from", [0, 3])
def test_blocks_whose_sender_hashes_differ_from_the_prompts_are_not_used(model_dir, colocated, same_from):
    """The transfer carries each block's chained hash; the decode engine keeps only the leading blocks whose
    hash equals the one it computes for its prompt. Another tenant's salt differs from the first block on;
    a prompt that differs from block 3 on keeps blocks 0-2 and computes the rest."""
    prefill, decode, address = pair(model_dir)
    sent = list(PROMPT) if same_from == 0 else PROMPT[: 3 * BLOCK] + [t + 1 for t in PROMPT[3 * BLOCK :]]
    salt = "other-tenant" if same_from == 0 else None
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill.add(AddRequest("r1", sent, first, cache_salt=salt, kv_transfer=KVTransferParams(hold=True)))
    run_until(prefill, lambda: not prefill.scheduler.has_unfinished())
    decode.add(AddRequest("r1", PROMPT, GREEDY, kv_transfer=KVTransferParams(transfer_id="t-r1")))
    assert prefill.pd.send("r1", address, "t-r1") == 5
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    assert final.outputs[0].token_ids == colocated
    assert final.metrics.num_cached_tokens == same_from * BLOCK
    stats = decode.kv.source("transfers").transfers.stats
    assert stats.hash_mismatches == 1 and stats.received == (1 if same_from else 0)
    assert decode.stats().kv_transfer_hash_mismatches == 1
    run_until(prefill, lambda: not prefill.has_unfinished_requests())
    for engine in (prefill, decode):
        engine.kv.block_manager.check_invariants()
        engine.shutdown()


@pytest.mark.parametrize(("prefill_dtype", "decode_dtype"), [("fp32", "int8"), ("int4", "bf16")])
def test_a_decode_engine_in_another_kv_dtype_gets_the_blocks_converted(model_dir, prefill_dtype, decode_dtype):
    prefill = make_llm(model_dir, prefill_dtype, role="prefill", backend="shm").engine
    decode = make_llm(model_dir, decode_dtype, role="decode", backend="shm").engine
    address = decode.pd.info().address
    assert prefill.kv_schema_digest == decode.kv_schema_digest  # same blocks, other precision
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill.add(AddRequest("r1", PROMPT, first, kv_transfer=KVTransferParams(hold=True)))
    run_until(prefill, lambda: not prefill.scheduler.has_unfinished())
    held = prefill.kv.source("transfers").transfers.held["r1"].seq.block_table[:5]
    # what the decode engine must end up with: the prefill's blocks re-encoded in its dtype
    expected = make_llm(model_dir, decode_dtype).engine.runner.pool
    source = prefill.runner.pool
    for layer in range(source.num_layers):
        k, v = source.gather_blocks(layer, torch.tensor([held]), torch.float32)
        expected.store(layer, k[0], v[0], torch.arange(5 * BLOCK))

    decode.add(AddRequest("r1", PROMPT, GREEDY, kv_transfer=KVTransferParams(transfer_id="t-r1")))
    assert prefill.pd.send("r1", address, "t-r1", kv_dtype=decode_dtype) == 5
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    assert final.metrics.num_cached_tokens == 5 * BLOCK  # the converted blocks were taken, hashes and all
    assert decode.kv.source("transfers").transfers.stats.hash_mismatches == 0 and len(final.outputs[0].token_ids) == 6
    cached = decode.kv.index.match(PROMPT, decode.extra_key(), record=False)  # registered under its own key
    assert len(cached.block_ids) == 5
    assert torch.equal(decode.runner.pool.read_blocks(cached.block_ids), expected.read_blocks(range(5)))
