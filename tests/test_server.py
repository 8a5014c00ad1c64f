"""The real server on a loopback port, driven by the official `openai` client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import assert_openai_error, running_router, running_server

IGNORE_EOS = {"ignore_eos": True}




def metrics(url: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = sample.name + json.dumps({k: v for k, v in sample.labels.items() if k != "model_name"},
                                           sort_keys=True)
            out[key] = sample.value
    return out


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    manager = server.backend.engine.kv.block_manager
    while time.monotonic() < deadline:
        if server.backend.num_in_flight == 0 and manager.get_utilization() == 0.0:
            return
        time.sleep(0.02)
    raise AssertionError("server did not go idle: blocks still in use")


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model] == ["tiny-llama"]


def test_completion_usage_and_length(client, server):
    r = client.completions.create(model=server.model, prompt="To be, or not", max_tokens=7, temperature=0,
                                  extra_body=IGNORE_EOS)
    prompt_tokens = len(server.backend.model_info().tokenizer.encode("To be, or not"))
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == prompt_tokens + 7
    assert r.choices[0].finish_reason == "length"
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_streaming_completion_equals_non_streaming(client, server):
    kwargs = dict(model=server.model, prompt="All the world", max_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_non_streaming_agree(client, server):
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Speak, friend."}], max_tokens=9,
                  temperature=0, extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 9


def test_stop_string_cuts_the_text(client, server):
    base = client.completions.create(model=server.model, prompt="Now is the winter", max_tokens=12, temperature=0,
                                     extra_body=IGNORE_EOS).choices[0].text
    pairs = [base[i : i + 2] for i in range(1, len(base) - 1)]
    stop = next(p for p in pairs if p.isascii() and p.isalpha())
    r = client.completions.create(model=server.model, prompt="Now is the winter", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]


def test_seed_reproduces_sampling(client, server):
    kwargs = dict(model=server.model, prompt="Whether tis nobler", max_tokens=12, temperature=1.0,
                  extra_body=IGNORE_EOS)
    a = client.completions.create(seed=42, **kwargs).choices[0].text
    b = client.completions.create(seed=42, **kwargs).choices[0].text
    c = client.completions.create(seed=7, **kwargs).choices[0].text
    assert a == b and a != c


def test_n_returns_n_choices(client, server):
    r = client.completions.create(model=server.model, prompt="Hark", max_tokens=5, temperature=1.0, n=3, seed=1,
                                  extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15


def test_cached_tokens_rise_on_a_repeated_prefix(client, server):
    prefix = list(range(100, 164))  # four full 16-token blocks
    first = client.completions.create(model=server.model, prompt=prefix + [7, 8], max_tokens=2, temperature=0,
                                      extra_body=IGNORE_EOS)
    second = client.completions.create(model=server.model, prompt=prefix + [9, 10, 11], max_tokens=2,
                                       temperature=0, extra_body=IGNORE_EOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64


def test_cache_salt_isolates_tenants(client, server):
    prompt = list(range(200, 240))
    body = dict(model=server.model, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(extra_body={"cache_salt": "alice", **IGNORE_EOS}, **body)
    alice = client.completions.create(extra_body={"cache_salt": "alice", **IGNORE_EOS}, **body)
    bob = client.completions.create(extra_body={"cache_salt": "bob", **IGNORE_EOS}, **body)
    assert alice.usage.prompt_tokens_details.cached_tokens == 32
    assert bob.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.model, prompt="Out, out", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)  # distinct token texts may collide


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_health_version_and_metrics_names(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server.url}/version").json()
    names = {f.name for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ("sage:num_requests_running", "sage:num_requests_waiting", "sage:kv_cache_usage_perc",
                 "sage:prefix_cache_queries", "sage:prefix_cache_hits", "sage:prompt_tokens",
                 "sage:generation_tokens", "sage:request_success", "sage:time_to_first_token_seconds",
                 "sage:inter_token_latency_seconds", "sage:e2e_request_latency_seconds",
                 "sage:request_queue_time_seconds", "sage:num_preemptions"):
        assert name in names


def test_prefix_cache_counters_survive_an_empty_prefix_index(client, server):
    prompt = list(range(300, 340))  # two full 16-token blocks
    for _ in range(2):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=1, extra_body=IGNORE_EOS)
    wait_idle(server)
    before = metrics(server.url)
    server.backend.engine.kv.block_manager.reset_prefix_cache()  # evicts every cached block
    assert len(server.backend.engine.kv.index) == 0
    after = metrics(server.url)
    assert after["sage:prefix_cache_hits_total{}"] == before["sage:prefix_cache_hits_total{}"] >= 32
    assert after["sage:prefix_cache_queries_total{}"] == before["sage:prefix_cache_queries_total{}"] >= 64


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = metrics(server.url).get('sage:request_success_total{"finished_reason": "abort"}', 0)
    body = {"model": server.model, "prompt": list(range(10, 90)), "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in received)
    wait_idle(server)
    after = metrics(server.url)['sage:request_success_total{"finished_reason": "abort"}']
    assert after == before + 1
    server.backend.engine.kv.block_manager.check_invariants()


def test_api_key_is_enforced(model_dir):
    with running_server(model_dir, api_key="sk-test", num_blocks=32) as secured:
        assert httpx.get(f"{secured.url}/health").status_code == 200
        missing = httpx.get(f"{secured.url}/v1/models")
        assert_openai_error(missing, 401)
        wrong = openai.OpenAI(base_url=f"{secured.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{secured.url}/v1", api_key="sk-test", max_retries=0)
        assert right.completions.create(model=secured.model, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_queue_full_is_429(model_dir):
    import concurrent.futures

    with running_server(model_dir, num_blocks=64, max_num_seqs=1, max_waiting=1) as busy:
        body = {"model": busy.model, "prompt": list(range(10, 40)), "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{busy.url}/v1/completions", json=body, timeout=60),
                                  range(8)))
        statuses = sorted(r.status_code for r in codes)
        assert 200 in statuses and 429 in statuses
        for response in codes:
            if response.status_code == 429:
                assert_openai_error(response, 429)


def test_engine_failure_fails_requests_with_5xx_and_health_503(model_dir, monkeypatch):
    """An internal engine error ends in-flight requests with an error instead of hanging,
    and /health reports it so an orchestrator can restart the process."""
    with running_server(model_dir, num_blocks=32) as broken:
        def explode():
            raise RuntimeError("simulated device fault")

        monkeypatch.setattr(broken.backend.engine, "step", explode)
        response = httpx.post(f"{broken.url}/v1/completions", json={"model": broken.model, "prompt": "x",
                                                                     "max_tokens": 4}, timeout=30)
        assert response.status_code >= 500
        assert "Traceback" not in response.text and "error" in response.json()

        def status(method: str, path: str, **kw) -> tuple[int | None, str]:
            """The answer's status and text; None once the server stopped itself (exit code 1, within
            HEALTH_WATCH_S of the failure, so that a supervisor restarts it): a busy machine can get there first."""
            try:
                reply = httpx.request(method, f"{broken.url}{path}", timeout=30, **kw)
            except httpx.ConnectError:
                return None, ""
            return reply.status_code, reply.text

        assert status("GET", "/health")[0] in (503, None)
        after, text = status("POST", "/v1/completions", json={"model": broken.model, "prompt": "x"})
        assert after in (503, None)
        assert "simulated device fault" not in response.text + text  # the fault stays in the log
        deadline = time.monotonic() + 10
        while broken.app.state.failed is None:  # the server noted why it stops
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "internal error" in broken.app.state.failed


def test_an_unexpected_error_is_a_500_to_the_client_and_a_traceback_in_the_log(model_dir, monkeypatch, caplog):
    """A bug met by one request: the client gets an OpenAI error without internals (a plain 500, or an in-band
    error event once a stream has started), the operator gets the traceback, and the engine keeps serving."""
    import logging

    with running_server(model_dir, num_blocks=32) as server:
        real = server.backend.add_request

        async def failing(job):
            async def stream():
                raise RuntimeError("simulated handler bug")
                yield  # pragma: no cover - makes this an async generator

            return stream()

        monkeypatch.setattr(server.backend, "add_request", failing)
        body = {"model": server.model, "prompt": "x", "max_tokens": 4}
        with caplog.at_level(logging.ERROR, logger="sage_infer.server"):
            plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert_openai_error(plain, 500)
        assert "simulated" not in plain.text + streamed.text and "Traceback" not in plain.text + streamed.text
        assert streamed.status_code == 200
        events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == 500 and events[-1] == "[DONE]"
        logged = [r for r in caplog.records if r.name == "sage_infer.server" and r.exc_info]
        assert len(logged) == 2 and all("simulated handler bug" in str(r.exc_info[1]) for r in logged)
        assert "/v1/completions" in logged[0].getMessage()

        monkeypatch.setattr(server.backend, "add_request", real)
        ok = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_an_idle_keep_alive_connection_outlives_the_client_pools_expiry(model_dir):
    """httpx (so the openai client) reuses an idle connection for up to 5 s: the model server and the P/D router
    must not close it first, or a request sent at that moment fails with "server disconnected"."""
    from sage_infer.server.launch import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > httpx.Limits().keepalive_expiry
    with running_server(model_dir, num_blocks=32) as server, running_router([], [server.url]) as router:
        with ThreadPoolExecutor(2) as pool:  # both idle at once: one wait
            list(pool.map(_reuse_after_idle, (server.url, router)))


def _reuse_after_idle(url: str) -> None:
    """GET /health twice on one connection, the second after the client pool's idle limit."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for idle in (0, httpx.Limits().keepalive_expiry + 1):
            time.sleep(idle)
            sock.sendall(request)
            head = _whole_response(sock)
            assert head.startswith(b"HTTP/1.1 200"), (url, head)


def _whole_response(sock) -> bytes:
    """Read one whole response (the head, then Content-Length bytes, which may come in several reads); its head."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return head
