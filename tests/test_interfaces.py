"""The shared contracts compute what they promise and reject what cannot be."""

from __future__ import annotations

import ast
import zlib
from pathlib import Path

import pytest

import sage_infer.core as core
import sage_infer.interfaces.backend as backend_module
import sage_infer.server as server
from sage_infer.core.messages import AbortRequest, AddRequest, EngineStats, HealthStatus, ModelInfo
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.interfaces import (
    InferenceBackend,
    KVCacheSchema,
    KVChunk,
    KVDtype,
    ScaleLayout,
    TransportPlan,
)

LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def test_bf16_block_bytes_match_llama_8b_arithmetic():
    schema = KVCacheSchema(**LLAMA_8B, dtype=KVDtype.BF16)
    # K and V x 16 tokens x 8 heads x 128 dims x 32 layers x 2 bytes = 2 MiB
    assert schema.bytes_per_block == 2 * 16 * 8 * 128 * 32 * 2 == 2 * 1024 * 1024
    assert schema.bytes_per_token() == 128 * 1024


@pytest.mark.parametrize("dtype,ratio", [(KVDtype.FP8_E4M3, 2), (KVDtype.INT8, 2), (KVDtype.INT4, 4)])
def test_quantized_data_is_smaller_by_bit_width(dtype, ratio):
    bf16 = KVCacheSchema(**LLAMA_8B, dtype=KVDtype.BF16)
    quant = KVCacheSchema(**LLAMA_8B, dtype=dtype, scale_layout=ScaleLayout.PER_HEAD)
    assert quant.data_bytes_per_block * ratio == bf16.data_bytes_per_block
    assert quant.scale_bytes_per_block == 0  # per-head scales travel with the schema


def test_per_token_scales_live_in_the_block():
    fp8 = KVCacheSchema(**LLAMA_8B, dtype=KVDtype.FP8_E4M3, scale_layout=ScaleLayout.PER_TOKEN)
    int8 = KVCacheSchema(**LLAMA_8B, dtype=KVDtype.INT8, scale_layout=ScaleLayout.PER_TOKEN)
    per_kv = 16 * 8 * 2  # tokens x heads x fp16
    assert fp8.scale_bytes_per_block == 32 * 2 * per_kv  # scale only
    assert int8.scale_bytes_per_block == 32 * 2 * per_kv  # symmetric: scale only


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype=KVDtype.INT8),  # quantized without scales
        dict(dtype=KVDtype.BF16, scale_layout=ScaleLayout.PER_TOKEN),  # scales on unquantized
        dict(block_size=0),
        dict(num_kv_heads=-1),
    ],
)
def test_schema_rejects_inconsistent_fields(kwargs):
    with pytest.raises(ValueError):
        KVCacheSchema(**{**LLAMA_8B, **kwargs})


def test_int4_needs_even_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        KVCacheSchema(num_layers=1, num_kv_heads=1, head_dim=63, dtype=KVDtype.INT4, scale_layout=ScaleLayout.PER_TOKEN)


def test_schema_round_trips_through_dict():
    schema = KVCacheSchema(**LLAMA_8B, dtype=KVDtype.FP8_E5M2, scale_layout=ScaleLayout.PER_TENSOR)
    assert KVCacheSchema.from_dict(schema.to_dict()) == schema
    assert schema.compatible_with(KVCacheSchema.from_dict(schema.to_dict()))
    assert not schema.compatible_with(KVCacheSchema(**LLAMA_8B))


def test_transport_plan_split_covers_every_byte_once():
    chunks = TransportPlan.split("r1", layer=3, nbytes=10_000_000, chunk_size=4 << 20, dtype=KVDtype.BF16)
    assert [c.offset for c in chunks] == [0, 4 << 20, 8 << 20]
    assert sum(c.length for c in chunks) == 10_000_000
    assert [c.is_last for c in chunks] == [False, False, True]
    schema = KVCacheSchema(**LLAMA_8B)
    plan = TransportPlan("r1", "prefill-0", "decode-0", "shm", schema, KVDtype.INT8, tuple(chunks))
    assert plan.total_bytes == 10_000_000 and plan.converts


def test_chunk_verify_detects_corruption_and_truncation():
    payload = bytes(range(256)) * 16
    chunk = KVChunk("r", 0, 0, 0, len(payload), KVDtype.FP16, crc32=zlib.crc32(payload))
    assert chunk.verify(payload)
    assert not chunk.verify(payload[:-1])
    corrupt = bytearray(payload)
    corrupt[100] ^= 0xFF
    assert not chunk.verify(bytes(corrupt))


def test_chunk_rejects_empty_length():
    with pytest.raises(ValueError):
        KVChunk("r", 0, 0, 0, 0, KVDtype.FP16)


class _Complete:
    """The smallest thing the server can run on: every protocol member, no engine."""

    name = "toy"

    def start(self):
        pass

    def shutdown(self, timeout=10.0):
        pass

    async def add_request(self, request):
        raise NotImplementedError

    def abort(self, request_id):
        pass

    def model_info(self):
        return ModelInfo("toy", tokenizer=None, chat_template=None, vocab_size=8, max_model_len=16)

    def stats(self):
        return EngineStats(num_running=0, num_waiting=0, kv_usage=0.0)

    def health(self):
        return HealthStatus(True)

    def on_finished(self, callback):
        pass


class _Incomplete:
    name = "half"

    def model_info(self):
        raise NotImplementedError


def test_backend_protocol_is_checkable():
    assert isinstance(_Complete(), InferenceBackend)
    assert not isinstance(_Incomplete(), InferenceBackend)


def test_front_end_messages_are_slotted_dataclasses():
    request = AddRequest("r", [1, 2], SamplingParams(stop=["\n"], logprobs=2, n=2, seed=3), priority=-1,
                         cache_salt="tenant")
    assert not hasattr(request, "__dict__") and not hasattr(AbortRequest("r"), "__dict__")
    assert request.params.stop == ["\n"] and request.priority == -1 and request.cache_salt == "tenant"


def _sage_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {name for name in names if name.startswith("sage_infer")}


def test_core_imports_nothing_else_of_sage_infer():
    for path in Path(core.__file__).parent.glob("*.py"):
        outside = {m for m in _sage_imports(path) if not m.startswith("sage_infer.core")}
        assert not outside, f"{path.name} imports {outside}"


def test_server_and_protocol_do_not_import_the_engine():
    """Only the registry picks a concrete backend; the server knows the protocol alone."""
    server_files = [*Path(server.__file__).parent.glob("*.py"), Path(backend_module.__file__)]
    for path in server_files:
        engine = {m for m in _sage_imports(path)
                  if m.startswith(("sage_infer.engine", "sage_infer.backends")) and m != "sage_infer.backends.registry"}
        assert not engine, f"{path.name} imports {engine}"
