"""Prefill/decode transfers of a hybrid model (KV groups): a Gemma-3-shaped model (two sliding-window layers of 16
tokens to every full one: one full group, two sliding ones) with blocks of 4 tokens and prompts over four windows
long, a prefill engine and a decode engine over the shm transport. The transfer carries every full-group block of
the prompt and only each sliding group's window; the decode engine continues token for token as transformers and a
single engine do, holding no more than a window per sliding group; the prefill engine's prefix cache serves a later
prompt; blocks convert to another KV dtype; a failed transfer frees the KV on both sides; workers whose KV groups
differ are refused."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import KVPoolConfig, ModelConfig, ServeConfig
from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.messages import AddRequest, KVTransferParams
from sage_infer.engine.llm_engine import LLMEngine, RequestError, kv_schema_digest
from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.kv_groups import kv_groups
from tests.test_engine_vs_transformers import random_prompts
from tests.tiny_models import save_tokenizer

WINDOW, BS, NEW = 16, 4, 8
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
STEM = random_prompts([70], seed=31)[0]  # 17 full blocks and 2 tokens
PROMPTS = {"stem": STEM, "whole-blocks": random_prompts([64], seed=32)[0], "longer": STEM + [7, 9, 11] * 4}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The model's directory and transformers' greedy tokens of each prompt."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=24)
    directory = tmp_path_factory.mktemp("pd-gemma3") / "model"
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, 512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    want = {}
    with torch.no_grad():
        for name, prompt in PROMPTS.items():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            want[name] = out[0, len(prompt):].tolist()
    return directory, want


def engine(directory, role: str = "both", kv_dtype: str = "auto", backend: str = "shm",
           **transport) -> LLMEngine:
    config = ServeConfig(model=ModelConfig(path=str(directory), dtype="fp32"),
                         kv_pool=KVPoolConfig(block_size=BS, num_blocks=160, kv_dtype=kv_dtype), role=role,
                         kv_transport=KVTransportConfig(backend=backend, **transport))
    return LLM(config=config, device="cpu").engine


def run_until(engine: LLMEngine, done, timeout: float = 20.0, each_step=None) -> list:
    outputs, deadline = [], time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        outputs += engine.step()
        if each_step is not None:
            each_step()
    return outputs


def prefill_and_hold(prefill: LLMEngine, request_id: str, prompt: list[int]):
    prefill.add(AddRequest(request_id, prompt, FIRST, kv_transfer=KVTransferParams(hold=True)))
    [out] = [o for o in run_until(prefill, lambda: not prefill.scheduler.has_unfinished()) if o.finished]
    return out


def test_the_decode_engine_continues_from_each_groups_blocks_token_for_token(gemma3):
    directory, want = gemma3
    single = LLM(config=ServeConfig(model=ModelConfig(path=str(directory), dtype="fp32"),
                                    kv_pool=KVPoolConfig(block_size=BS, num_blocks=160)), device="cpu")
    assert [o.outputs[0].token_ids for o in single.generate(list(PROMPTS.values()), GREEDY)] == list(want.values())
    prefill, decode = engine(directory, "prefill"), engine(directory, "decode")
    address, kv = decode.pd.info().address, decode.kv
    assert isinstance(kv, GroupKVCacheManager) and [g.kind for g in kv.groups.groups] == ["full"] + ["sliding 16"] * 2
    window = kv.groups.window_blocks(1, BS)  # 4 blocks: the keys a query after the hit sees
    peak = [0, 0, 0]

    def held():
        for seq in decode.scheduler.running:
            peak[:] = [max(a, b) for a, b in zip(peak, kv.held_blocks(seq))]

    for name, prompt in PROMPTS.items():
        first = prefill_and_hold(prefill, name, prompt)
        assert first.outputs[0].token_ids == want[name][:1]
        hit = (len(prompt) - 1) // BS  # the decode engine computes the last token: its hit's blocks
        decode.add(AddRequest(name, prompt, GREEDY, kv_transfer=KVTransferParams(transfer_id=f"t-{name}")))
        rows = prefill.pd.send(name, address, f"t-{name}")
        assert rows == hit + 2 * window  # every full-group block, a window per sliding group: not 3 x hit
        [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests(), each_step=held)
                   if o.finished]
        assert final.outputs[0].token_ids == want[name]
        if name == "longer":  # its stem's blocks were registered by the first transfer: only the rest came
            assert first.metrics.num_cached_tokens == 17 * BS  # the prefill engine's own prefix cache served it
        assert final.metrics.num_cached_tokens == hit * BS
    assert peak[0] > 2 * window and max(peak[1:]) <= window + 1  # a sliding group: its window and the next block
    run_until(prefill, lambda: not prefill.has_unfinished_requests())  # the sends were acknowledged: freed
    sent, received = prefill.kv.source("transfers").transfers.stats, kv.source("transfers").transfers.stats
    assert (sent.sent, sent.send_failures, received.received, received.hash_mismatches) == (3, 0, 3, 0)
    for worker in (prefill, decode):
        worker.kv.block_manager.check_invariants()
        assert worker.kv.block_manager.num_used_blocks == 1  # the null block only
        worker.shutdown()


def test_a_failed_transfer_frees_the_kv_on_both_sides(gemma3, tmp_path):
    directory, want = gemma3
    prefill, decode = engine(directory, "prefill"), engine(directory, "decode", timeout_s=0.5)
    prefill_and_hold(prefill, "r1", STEM)
    assert prefill.kv.block_manager.num_used_blocks > 1  # held for the decode engine
    decode.add(AddRequest("r1", STEM, GREEDY, kv_transfer=KVTransferParams(transfer_id="t-r1")))
    prefill.pd.send("r1", f"shm://{tmp_path}/nobody-listens", "t-r1")
    run_until(prefill, lambda: not prefill.has_unfinished_requests())
    assert prefill.kv.source("transfers").transfers.stats.send_failures == 1
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    assert final.outputs[0].token_ids == want["stem"] and final.metrics.num_cached_tokens == 0  # computed
    assert decode.kv.source("transfers").transfers.stats.receive_failures == 1
    for worker in (prefill, decode):
        worker.kv.block_manager.check_invariants()
        assert worker.kv.block_manager.num_used_blocks == 1
        worker.shutdown()


def test_a_decode_engine_in_another_kv_dtype_gets_each_groups_blocks_converted(gemma3):
    """fp32 blocks re-encoded in int8 and keyed under the decode engine's key: the same tokens as one int8 engine."""
    directory, _ = gemma3
    single = engine(directory, kv_dtype="int8")
    single.add(AddRequest("r1", STEM, GREEDY))
    [want] = [o for o in run_until(single, lambda: not single.has_unfinished_requests()) if o.finished]
    prefill, decode = engine(directory, "prefill"), engine(directory, "decode", "int8")
    prefill_and_hold(prefill, "r1", STEM)
    decode.add(AddRequest("r1", STEM, GREEDY, kv_transfer=KVTransferParams(transfer_id="t-r1")))
    prefill.pd.send("r1", decode.pd.info().address, "t-r1", kv_dtype="int8")
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    assert final.metrics.num_cached_tokens == 17 * BS and decode.kv.source("transfers").transfers.stats.received == 1
    assert final.outputs[0].token_ids == want.outputs[0].token_ids
    run_until(prefill, lambda: not prefill.has_unfinished_requests())
    for worker in (single, prefill, decode):
        worker.shutdown()


def test_workers_whose_kv_groups_differ_are_refused_before_a_transfer(gemma3):
    directory, _ = gemma3
    decode = engine(directory, "decode")
    schema = decode.runner.pool.schema
    assert decode.kv_schema_digest == decode.pd.info().schema_digest
    other_window = kv_schema_digest(schema, kv_groups([8, 8, None] * 2))
    plain = kv_schema_digest(schema)  # the same blocks, every layer in one full group
    for digest in (other_window, plain):
        with pytest.raises(RequestError, match="KV groups"):
            decode.add(AddRequest("r1", STEM, GREEDY, kv_transfer=KVTransferParams(transfer_id="t",
                                                                                   schema_digest=digest)))
    assert not decode.has_unfinished_requests()
    decode.shutdown()


@pytest.mark.parametrize("target_dtype", [None, "int8"])
def test_a_tcp_transfer_carries_each_groups_blocks(gemma3, target_dtype):
    """The same per-group transfer over tcp, as stored and with int8 on the wire (converted back on arrival)."""
    directory, want = gemma3
    prefill = engine(directory, "prefill", backend="tcp", target_dtype=target_dtype)
    decode = engine(directory, "decode", backend="tcp", target_dtype=target_dtype)
    prefill_and_hold(prefill, "r1", STEM)
    decode.add(AddRequest("r1", STEM, GREEDY, kv_transfer=KVTransferParams(transfer_id="t-r1")))
    address = decode.pd.info().address
    assert address.startswith("tcp://")
    window = decode.kv.groups.window_blocks(1, BS)
    assert prefill.pd.send("r1", address, "t-r1") == 17 + 2 * window
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    assert final.metrics.num_cached_tokens == 17 * BS
    stats = decode.kv.source("transfers").transfers.stats
    assert (stats.received, stats.hash_mismatches, stats.receive_failures) == (1, 0, 0)
    if target_dtype is None:  # as stored: transformers' tokens; int8 on the wire rounds the KV once
        assert final.outputs[0].token_ids == want["stem"]
    run_until(prefill, lambda: not prefill.has_unfinished_requests())
    for worker in (prefill, decode):
        worker.kv.block_manager.check_invariants()
        assert worker.kv.block_manager.num_used_blocks == 1
        worker.shutdown()
