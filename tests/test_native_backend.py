"""The native engine behind the InferenceBackend protocol: a real engine on a tiny model,
driven the way the server drives it (engine thread, asyncio streams)."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from sage_infer.backends.native import NativeBackend, create
from sage_infer.backends.registry import create_backend
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig
from sage_infer.core.messages import AddRequest
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.errors import ConfigError
from sage_infer.interfaces import InferenceBackend, InvalidRequestError, QueueFullError
from tests.tiny_models import make_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("native") / "tiny-qwen3", "qwen3")
    return ServeConfig(model=ModelConfig(path=str(directory), dtype="fp32"), kv_pool=KVPoolConfig(num_blocks=32))


@pytest.fixture
def backend(config):
    backend = create(config)
    backend.start()
    yield backend
    backend.shutdown()


def add(request_id: str, ids: list[int], max_tokens: int, **kwargs) -> AddRequest:
    return AddRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, **GREEDY), **kwargs)


async def drain(stream) -> list:
    return [output async for output in stream]


def test_native_backend_implements_the_protocol(backend):
    assert isinstance(backend, InferenceBackend)
    assert backend.name == "native"


def test_registry_builds_the_backend_the_config_names(config):
    backend = create_backend(config)
    try:
        assert isinstance(backend, NativeBackend) and backend.model_info().name == "tiny-qwen3"
    finally:
        backend.shutdown()


def test_two_requests_stream_to_the_end_and_free_their_blocks(backend):
    async def run():
        a = await backend.add_request(add("a", list(range(5, 25)), 4))
        b = await backend.add_request(add("b", list(range(5, 40)), 6))
        return await asyncio.gather(drain(a), drain(b))

    outs_a, outs_b = asyncio.run(run())
    assert [o.finished for o in outs_a][-1] and len(outs_a[-1].outputs[0].token_ids) == 4
    assert outs_b[-1].outputs[0].finish_reason == "length" and len(outs_b[-1].outputs[0].token_ids) == 6
    stats = backend.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    backend.engine.kv.block_manager.check_invariants()


def test_model_info_describes_the_served_model(backend):
    info = backend.model_info()
    assert (info.name, info.vocab_size, info.max_model_len) == ("tiny-qwen3", 512, 1024)
    assert info.chat_template is not None and info.tokenizer.encode("hello")
    assert info.max_bytes_per_token is not None  # byte-level BPE: the size bound applies


def test_token_ids_from_the_front_end_are_not_tokenized_again(backend, monkeypatch):
    calls = []
    monkeypatch.setattr(backend.engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or [])
    request = add("t", [11, 12, 13, 14], 2, prompt="the text these ids came from")

    async def run():
        return await drain(await backend.add_request(request))

    final = asyncio.run(run())[-1]
    assert calls == []
    assert final.prompt == "the text these ids came from" and final.prompt_token_ids == [11, 12, 13, 14]


def test_abort_ends_the_stream_with_finish_reason_abort(backend):
    async def run():
        stream = await backend.add_request(add("long", list(range(5, 30)), 500))
        first = await anext(stream)
        backend.abort("long")
        return [first] + await drain(stream)

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert backend.stats().kv_usage == 0.0


def test_finished_callback_sees_every_request_aborts_included(backend):
    seen = []
    backend.on_finished(lambda output: seen.append((output.request_id, output.outputs[0].finish_reason)))

    async def run():
        done = await backend.add_request(add("done", [5, 6, 7], 2))
        await drain(done)
        stopped = await backend.add_request(add("stopped", [5, 6, 7], 500))
        await anext(stopped)
        await stopped.aclose()  # leaving the stream early aborts the request
        while backend.num_in_flight:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert seen == [("done", "length"), ("stopped", "abort")]


def test_a_prompt_longer_than_the_pool_is_an_invalid_request(backend):
    pool_tokens = 32 * 16

    async def run():
        await backend.add_request(add("big", [5] * pool_tokens, 1))

    with pytest.raises(InvalidRequestError, match="KV pool"):
        asyncio.run(run())


def test_a_duplicate_request_id_is_an_invalid_request(backend):
    async def run():
        first = await backend.add_request(add("same", [5, 6, 7], 50))
        try:
            await backend.add_request(add("same", [5, 6, 7], 1))
        finally:
            await first.aclose()

    with pytest.raises(InvalidRequestError, match="already in use"):
        asyncio.run(run())


def test_more_waiting_requests_than_allowed_is_queue_full(config):
    backend = NativeBackend(create(config).engine, max_waiting=1)  # not started: nothing leaves the queue

    async def run():
        accepted = asyncio.ensure_future(backend.add_request(add("w1", [5, 6], 1)))
        await asyncio.sleep(0)
        try:
            await backend.add_request(add("w2", [5, 6], 1))
        finally:
            accepted.cancel()

    with pytest.raises(QueueFullError, match="max 1"):
        asyncio.run(run())


def test_stats_keep_prefix_counters_when_the_prefix_index_is_empty(backend):
    prompt = list(range(100, 140))  # two full 16-token blocks

    async def run():
        for request_id in ("p1", "p2"):
            await drain(await backend.add_request(add(request_id, prompt, 1)))

    asyncio.run(run())
    backend.engine.kv.block_manager.reset_prefix_cache()
    assert len(backend.engine.kv.index) == 0
    stats = backend.stats()
    assert stats.prefix_caching and stats.prefix_query_tokens >= 64 and stats.prefix_hit_tokens == 32


VLLM_HERE = importlib.util.find_spec("vllm") is not None
NEEDS_NO_VLLM = pytest.mark.skipif(VLLM_HERE, reason="vllm is installed in this python, so backend vllm is available "
                                   "(tests/test_vllm_backend.py covers it)")


@pytest.mark.parametrize("name", [pytest.param("vllm", marks=NEEDS_NO_VLLM), "lmdeploy", "no-such-engine"])
def test_an_unavailable_backend_fails_at_start_saying_why(config, name):
    with pytest.raises(ConfigError, match=f"^backend {name} is not available: "):
        create_backend(config.model_copy(update={"backend": name}))


@NEEDS_NO_VLLM
def test_serve_with_an_unavailable_backend_exits_2_with_one_line(sage):
    result = sage("llm", "serve", "--set", "backend=vllm", "--port", "0")
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sage: error: backend vllm is not available: ")


def test_backends_list_reports_native_available(sage):
    result = sage("infer", "backends:list", "--json")
    native = next(b for b in json.loads(result.out)["backends"] if b["name"] == "native")
    assert native["available"] is True and native["reason"] is None


def test_scheduler_limits_reach_the_backend(config):
    backend = create(config.model_copy(update={"scheduler": SchedulerConfig(max_waiting=7)}))
    assert backend.max_waiting == 7
