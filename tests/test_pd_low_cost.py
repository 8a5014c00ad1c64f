"""Prefill/decode with KV converted on the wire (`kv_transport.target_dtype`, the `low-cost` preset's int8).

The prefill engine encodes its blocks with the pool's own codec (`convert_blocks`); the decode engine stores
them as they came when its pool keeps the wire's dtype, else converts them back to its pool's. The bytes
on the wire are the converted ones (and the CRC covers them). Real engines over a real transport, and one
real `sage llm serve --pd 1P1D` deployment with the preset on the demo model, through the openai client.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile

import openai
import pytest
import torch

from sage_infer import LLM, SamplingParams
from sage_infer.core.kv_schema import KVDtype
from sage_infer.core.messages import AddRequest, KVTransferParams
from sage_infer.kv_runtime.kv_pipe import _DroppingBuffers
from sage_infer.kv_runtime.quantized_pool import convert_blocks, convert_rows
from sage_infer.models.loader import DEMO_MODEL_DIR
from sage_infer.transport.wire import ChunkHeader, Flag, Kind
from tests.test_kv_transfer_engine import BLOCK, GREEDY, PROMPT, make_llm, run_until


@pytest.fixture(scope="module")
def model_dir():
    return DEMO_MODEL_DIR  # the shipped demo model: real weights, nothing to build


@pytest.fixture(scope="module")
def prefill(model_dir):
    """One prefill engine (bf16 pool, int8 on the wire) for every in-process test: each holds its own request."""
    engine = make_llm(model_dir, "bf16", role="prefill", backend="tcp", target_dtype="int8").engine
    yield engine
    engine.shutdown()


def transfer(prefill, decode, rid: str, kv_dtype: str | None = None):
    """`rid`'s prompt computed and held by `prefill`, sent to `decode` over tcp; (the decode's final output, the
    held blocks in int8 as the prefill's codec encodes them)."""
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill.add(AddRequest(rid, PROMPT, first, kv_transfer=KVTransferParams(hold=True)))
    run_until(prefill, lambda: not prefill.scheduler.has_unfinished())
    held = prefill.kv.source("transfers").transfers.held[rid].seq.block_table[:5]
    wire_rows = convert_blocks(prefill.runner.pool, held, prefill.runner.pool.schema.with_dtype(KVDtype.INT8))
    decode.add(AddRequest(rid, PROMPT, GREEDY, kv_transfer=KVTransferParams(transfer_id=f"t-{rid}")))
    assert prefill.pd.send(rid, decode.pd.info().address, f"t-{rid}", kv_dtype=kv_dtype) == 5
    [final] = [o for o in run_until(decode, lambda: not decode.has_unfinished_requests()) if o.finished]
    return final, wire_rows


def test_a_bf16_decode_engine_converts_the_int8_wire_blocks_back(model_dir, prefill):
    decode = make_llm(model_dir, "bf16", role="decode", backend="tcp", target_dtype="int8").engine
    try:
        final, wire_rows = transfer(prefill, decode, "r-bf16")
        transfers = decode.kv.source("transfers").transfers
        assert final.metrics.num_cached_tokens == 5 * BLOCK and transfers.stats.hash_mismatches == 0
        # the wire carried the quantized rows (plus the 32-byte hashes), not bf16's
        assert transfers.stats.bytes_received == wire_rows.numel() + 5 * 32
        assert wire_rows.shape[1] < decode.runner.pool.block_nbytes
        cached = decode.kv.index.match(PROMPT, decode.extra_key(), record=False)
        pool = decode.runner.pool
        want = convert_rows(wire_rows, pool.schema.with_dtype(KVDtype.INT8), pool.schema)
        assert torch.equal(pool.read_blocks(cached.block_ids).view(torch.uint8).reshape(5, -1), want)
        assert len(final.outputs[0].token_ids) == GREEDY.max_tokens
        # both conversions are counted: the prefill's encoding into int8, this engine's decoding back to bf16
        assert prefill.kv.source("transfers").transfers.stats.send_convert_seconds > 0
        [_, receive] = decode.stats().kv_transfers
        assert receive[0] == "receive" and receive[5] == transfers.stats.receive_convert_seconds > 0
    finally:
        decode.shutdown()


def test_a_decode_engine_whose_pool_is_the_wire_dtype_stores_the_blocks_as_they_came(model_dir, prefill):
    decode = make_llm(model_dir, "int8", role="decode", backend="tcp", target_dtype="int8").engine
    try:
        final, wire_rows = transfer(prefill, decode, "r-int8", kv_dtype="int8")
        transfers = decode.kv.source("transfers").transfers
        assert final.metrics.num_cached_tokens == 5 * BLOCK and transfers.stats.hash_mismatches == 0
        cached = decode.kv.index.match(PROMPT, decode.extra_key(), record=False)
        assert torch.equal(decode.runner.pool.read_blocks(cached.block_ids), wire_rows)  # bit-exact, no re-encode
        assert transfers.stats.receive_convert_seconds == 0
    finally:
        decode.shutdown()


def test_workers_with_different_wire_dtypes_fail_the_transfer_at_once_and_compute(model_dir, prefill, caplog):
    decode = make_llm(model_dir, "bf16", role="decode", backend="tcp", timeout_s=600).engine  # no wire dtype
    try:
        # the int8 rows are shorter than the bf16 ones expected; a 600 s deadline: only the failure can end
        # the wait within run_until's
        final, _ = transfer(prefill, decode, "r-mismatch")
        assert final.metrics.num_cached_tokens == 0 and len(final.outputs[0].token_ids) == GREEDY.max_tokens
        assert decode.kv.source("transfers").transfers.stats.receive_failures == 1
        assert "both workers must set the same kv_transport.target_dtype" in caplog.text
    finally:
        decode.shutdown()


def test_rows_past_or_short_of_the_expected_size_mark_the_transfer_mismatched():
    buffers = _DroppingBuffers()
    for rid in ("long", "short", "fits"):
        buffers.register(rid, [torch.empty(100, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)])
    buffers.sink(ChunkHeader(Kind.DATA, "long", layer=0, offset=64, length=64))  # runs past byte 100
    buffers.sink(ChunkHeader(Kind.DATA, "short", layer=0, offset=0, length=60, flags=Flag.LAST))  # ends at 60
    buffers.sink(ChunkHeader(Kind.DATA, "fits", layer=0, offset=40, length=60, flags=Flag.LAST))
    buffers.sink(ChunkHeader(Kind.DATA, "fits", layer=1, offset=0, length=32, flags=Flag.LAST))
    assert set(buffers.mismatched) == {"long", "short"}
    assert "kv_transport.target_dtype" in buffers.mismatched["long"]


DEMO_PROMPT = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
               "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.")


def greedy_through_the_deployment(*flags: str, max_tokens: int) -> tuple[str, list[str], int]:
    """`sage llm serve --pd 1P1D` on the demo model: (text, its tokens, cached prompt tokens) of one greedy
    completion through the openai client; SIGTERM stops it (exit 0)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SAGE_API_KEY", None)
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--pd", "1P1D",
                             *flags, "--port", "0"], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 ", line)
        if not match:
            stderr.seek(0)
            raise AssertionError(f"unexpected first line: {line!r}; stderr: {stderr.read()[-2000:]}")
        client = openai.OpenAI(base_url=f"{match.group(1)}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=DEMO_PROMPT, max_tokens=max_tokens, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True})
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    assert code == 0
    stderr.seek(0)
    assert "as int8," in stderr.read()  # both workers logged their pipe's wire dtype
    return got.choices[0].text, got.choices[0].logprobs.tokens, got.usage.prompt_tokens_details.cached_tokens


def test_the_low_cost_preset_serves_a_pd_deployment_end_to_end():
    text, tokens, cached = greedy_through_the_deployment("--kv-transport", "preset=low-cost", max_tokens=16)
    llm = LLM(device="cpu")  # the demo model, colocated: its KV never leaves bf16
    [want] = llm.generate([DEMO_PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    ref = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in want.outputs[0].token_ids]
    assert cached > 0  # the prompt's full blocks came from the prefill worker, as int8
    assert text.strip() and len(tokens) == 16
    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(ref))
    print(f"int8 wire: {agree} of {len(ref)} greedy tokens equal the colocated engine's; "
          f"{text!r} vs {want.outputs[0].text!r}")
    # the first token is the prefill worker's (computed from its own KV); the next ones read int8-converted KV
    assert agree >= 4, (tokens, ref)
