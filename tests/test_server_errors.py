"""How the server refuses requests: OpenAI-style JSON errors with a useful message, never a
Python exception's text, and never after spending seconds on a request that cannot run."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_fixture import assert_openai_error, post_raw, running_server

# words that only appear when a Python exception leaks into a client-facing message
PYTHON_ERROR_TEXT = ("Error:", "Exception", "Traceback", "got multiple values", "RuntimeError", "TypeError")




def assert_no_python_error_text(text: str) -> None:
    leaked = [word for word in PYTHON_ERROR_TEXT if word in text]
    assert not leaked, f"{leaked} in {text!r}"


def test_malformed_json_is_400(server):
    assert_openai_error(post_raw(server, "/v1/completions", b'{"model": "tiny-llama", "prompt": '), 400)


def test_wrong_field_type_is_400_naming_it(server):
    body = json.dumps({"model": server.model, "prompt": "x", "max_tokens": "lots"})
    assert "max_tokens" in assert_openai_error(post_raw(server, "/v1/completions", body), 400)


def test_missing_messages_is_400(server):
    body = json.dumps({"model": server.model})
    assert "messages" in assert_openai_error(post_raw(server, "/v1/chat/completions", body), 400)


def test_out_of_range_temperature_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="x", temperature=5)
    assert err.value.status_code == 400


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-5", prompt="x")
    assert "gpt-5" in str(err.value)


def test_context_overflow_is_400_with_the_numbers(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt=[5] * 1000, max_tokens=100)
    message = str(err.value)
    assert "1024" in message and "1100" in message and "1000 in the prompt" in message


def test_body_too_large_is_413(server):
    body = json.dumps({"model": server.model, "prompt": "x" * (5 * 1024 * 1024)})
    assert_openai_error(post_raw(server, "/v1/completions", body), 413)


def test_bad_token_ids_are_400(server):
    body = json.dumps({"model": server.model, "prompt": [1, 2, 999999]})
    assert_openai_error(post_raw(server, "/v1/completions", body), 400)


def _nested_stop(model: str, depth: int) -> bytes:
    return f'{{"model": "{model}", "prompt": "x", "stop": {"[" * depth}{"]" * depth}}}'.encode()


@pytest.mark.parametrize("depth", [1_000, 10_000])
def test_deeply_nested_json_is_400(server, depth):
    message = assert_openai_error(post_raw(server, "/v1/completions", _nested_stop(server.model, depth)), 400)
    assert "nested too deeply" in message


def test_brackets_inside_strings_are_not_nesting(client, server):
    prompt = "[{" * 150 + '\\"]' + "[" * 100
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("reserved", ["messages", "add_generation_prompt", "tools"])
def test_chat_template_kwargs_cannot_replace_reserved_arguments(server, reserved):
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {reserved: []}}
    message = assert_openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400)
    assert "reserved" in message and reserved in message
    assert_no_python_error_text(message)


def test_chat_template_kwargs_reach_the_template(client, server):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens == 1


HUGE = "All the world's a stage. " * 156_000  # 3.9 MB, under the 4 MiB body limit


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": HUGE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}),
])
def test_a_prompt_of_megabytes_is_rejected_by_size_without_tokenizing_it(server, monkeypatch, path, body):
    tokenizer = server.backend.model_info().tokenizer
    encoded_lengths = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode",
                        lambda text, *a, **k: encoded_lengths.append(len(text)) or encode(text, *a, **k))
    response = httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=60)
    message = assert_openai_error(response, 400)
    assert "maximum context length is 1024 tokens" in message and "rejected by size" in message
    assert all(n < len(HUGE) // 2 for n in encoded_lengths), "the huge prompt was tokenized"


def test_a_failure_mid_stream_reports_no_python_exception_text(model_dir, monkeypatch):
    with running_server(model_dir, num_blocks=32) as broken:
        def explode():
            raise RuntimeError("simulated device fault")

        monkeypatch.setattr(broken.backend.engine, "step", explode)
        body = {"model": broken.model, "prompt": "x", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{broken.url}/v1/completions", json=body, timeout=30) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: {")]
        errors = [json.loads(line[6:])["error"] for line in events if '"error"' in line]
        assert errors and errors[-1]["code"] == 503
        assert_no_python_error_text(errors[-1]["message"])
        assert "simulated device fault" not in errors[-1]["message"]


@pytest.mark.parametrize("seed, n", [(2**64, 1), (2**64 - 1, 2), (-(2**63) - 1, 1)])
def test_a_seed_outside_64_bits_is_400_and_the_engine_keeps_serving(client, server, seed, n):
    body = json.dumps({"model": server.model, "prompt": "a", "max_tokens": 2, "seed": seed, "n": n})
    status = post_raw(server, "/v1/completions", body)
    if 0 <= seed < 2**64:  # in range: the sibling's seed + 1 wraps around instead of overflowing the generator
        assert status.status_code == 200, status.text
        assert len(status.json()["choices"]) == n
    else:
        assert "seed" in assert_openai_error(status, 400)
    # the next request is served: one request never takes the engine down
    assert client.completions.create(model=server.model, prompt="a", max_tokens=2).choices[0].text is not None
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_integer_of_thousands_of_digits_is_400(server, path):
    body = json.dumps({"model": server.model, "max_tokens": 0, "prompt": "a", "messages": []})
    body = body.replace('"max_tokens": 0', f'"max_tokens": {"9" * 5000}')
    assert_no_python_error_text(assert_openai_error(post_raw(server, path, body), 400))


def test_a_lone_surrogate_in_a_prompt_is_400_naming_the_field(server):
    body = json.dumps({"model": server.model, "max_tokens": 2, "prompt": "a\ud800b"})  # json writes it as \ud800
    assert "prompt" in assert_openai_error(post_raw(server, "/v1/completions", body), 400)
    paired = json.dumps({"model": server.model, "max_tokens": 2, "prompt": "a\U0001f600b"})  # an emoji: fine
    assert post_raw(server, "/v1/completions", paired).status_code == 200


@pytest.mark.parametrize("field, value", [("top_k", 10**30), ("stop_token_ids", [2**64])])
def test_out_of_range_token_counts_and_ids_are_400(server, field, value):
    body = json.dumps({"model": server.model, "prompt": "a", "max_tokens": 2, field: value})
    assert field in assert_openai_error(post_raw(server, "/v1/completions", body), 400)


def test_a_request_that_meets_an_engine_bug_fails_alone_and_is_counted(client, server, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    engine = server.backend.engine
    add = engine.add

    def add_or_fail(command):  # a fault injected for one prompt: what any unexpected exception in add does
        if command.prompt == "boom":
            raise RuntimeError("injected")
        return add(command)

    monkeypatch.setattr(engine, "add", add_or_fail)
    failed = post_raw(server, "/v1/completions", json.dumps({"model": server.model, "prompt": "boom", "max_tokens": 2}))
    assert failed.status_code >= 400 and "error" in failed.json()
    assert client.completions.create(model=server.model, prompt="a", max_tokens=2).choices
    assert httpx.get(f"{server.url}/health").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    assert families["sage:request_engine_failures"].samples[0].value >= 1
    assert server.backend.num_in_flight == 0  # nothing of the failed request is left behind


def test_the_openapi_schema_needs_the_key_and_lists_no_internal_routes(model_dir):
    with running_server(model_dir, api_key="sk-test", num_blocks=32) as secured:
        assert_openai_error(httpx.get(f"{secured.url}/openapi.json"), 401)
        schema = httpx.get(f"{secured.url}/openapi.json", headers={"Authorization": "Bearer sk-test"})
        assert schema.status_code == 200
        paths = schema.json()["paths"]
        assert "/v1/completions" in paths and "/v1/chat/completions" in paths
        assert not [p for p in paths if p.startswith("/v1/kv/")]
        assert httpx.get(f"{secured.url}/health").status_code == 200  # /health, /version, /metrics stay open


def test_a_dead_engine_stops_the_server_so_a_supervisor_restarts_it(model_dir, capfd):
    """The engine thread dying (here: a step raising what no request caused) fails the requests in flight with
    503, and the server stops itself instead of answering 503 for ever in a process that looks alive."""
    import time

    from sage_infer.config.serve import KVPoolConfig, ModelConfig, ServeConfig
    from sage_infer.server.launch import build_server
    from tests.server_fixture import serving

    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"), kv_pool=KVPoolConfig(num_blocks=64),
                         port=0)
    server, backend, model_name = build_server(config, drain_seconds=2)

    def broken_step():
        raise RuntimeError("a fault no request caused")

    backend.engine.step = broken_step
    with serving(server) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": model_name, "prompt": "a", "max_tokens": 2},
                              timeout=30)
        assert response.status_code == 503 and response.json()["error"]["type"]
        deadline = time.monotonic() + 10
        while not server.should_exit:
            assert time.monotonic() < deadline, "the server kept running with a dead engine"
            time.sleep(0.05)
    assert server.config.app.state.failed
    assert "stopping the server (exit code 1)" in capfd.readouterr().err


def test_streams_still_running_when_the_drain_ends_get_an_error_event_and_done(model_dir):
    """A shutdown waits `drain_seconds` for requests to finish; one still streaming just before the end gets an
    in-band 503 error and `[DONE]` (not a cut connection), a plain request a 503 body, and their KV is freed.
    The engine is slowed (a sleep per step) so the requests outlast a 2 s drain."""
    import threading
    import time

    from sage_infer.config.serve import KVPoolConfig, ModelConfig, ServeConfig
    from sage_infer.server.launch import build_server
    from tests.server_fixture import serving

    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"), kv_pool=KVPoolConfig(num_blocks=64),
                         port=0)
    server, backend, model_name = build_server(config, drain_seconds=2)
    step = backend.engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    backend.engine.step = slow_step
    lines: list[str] = []
    plain: list[httpx.Response] = []
    body = {"model": model_name, "prompt": "a", "max_tokens": 500, "ignore_eos": True}
    with serving(server) as url:
        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as response:
                lines.extend(line for line in response.iter_lines() if line)

        readers = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: plain.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                            timeout=30)))]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 20
        while len(lines) < 3:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.02)
        server.should_exit = True  # what uvicorn does on SIGTERM
        for reader in readers:
            reader.join(20)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert error["error"]["code"] == 503 and "drain" in error["error"]["message"]
    assert len(lines) < 500  # cut off, not finished
    assert plain[0].status_code == 503 and "drain" in plain[0].json()["error"]["message"]
    manager = backend.engine.kv.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0


def test_a_request_of_too_many_sequences_is_400(server):
    """One request may not hold the engine for minutes by its size: prompts x n is bounded like other fields."""
    body = {"model": server.model, "prompt": [[5, 6, 7]] * 129, "n": 2, "max_tokens": 1}
    message = assert_openai_error(post_raw(server, "/v1/completions", json.dumps(body)), 400)
    assert "at most 256 sequences per request" in message
    body["n"] = 1
    assert post_raw(server, "/v1/completions", json.dumps(body)).status_code == 200
