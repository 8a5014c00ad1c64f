"""The native engine behind the InferenceBackend protocol."""

from __future__ import annotations

import asyncio
import json

from sage_infer.backends.native import NativeBackend
from sage_infer.config.serve import KVPoolConfig, ModelConfig, ServeConfig
from sage_infer.interfaces import GenerateRequest, InferenceBackend
from tests.tiny_models import make_tiny_model


def test_native_backend_streams_tokens_and_frees_blocks(tmp_path):
    directory = make_tiny_model(tmp_path / "m", "qwen3")
    backend = NativeBackend(ServeConfig(model=ModelConfig(path=str(directory), dtype="fp32"),
                                        kv_pool=KVPoolConfig(num_blocks=32)))
    assert isinstance(backend, InferenceBackend)
    requests = [GenerateRequest("a", list(range(5, 25)), max_tokens=4, temperature=0.0, ignore_eos=True),
                GenerateRequest("b", list(range(5, 40)), max_tokens=6, temperature=0.0, ignore_eos=True)]

    async def collect():
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        reasons = {}
        async for out in backend.generate(requests):
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        return tokens, reasons

    tokens, reasons = asyncio.run(collect())
    assert (len(tokens["a"]), len(tokens["b"])) == (4, 6)
    assert reasons == {"a": "length", "b": "length"}
    stats = backend.kv_stats()
    assert stats.num_blocks == 32 and stats.usage <= 1.0
    assert backend.engine.kv.block_manager.get_utilization() == 0.0
    capabilities = backend.capabilities()
    assert capabilities.supports_prefix_caching and capabilities.kv_dtypes[0].value == "fp32"


def test_backends_list_reports_native_available(sage):
    result = sage("infer", "backends:list", "--json")
    native = next(b for b in json.loads(result.out)["backends"] if b["name"] == "native")
    assert native["available"] is True and native["reason"] is None
