"""A fleet of whole-model replicas behind the KV-aware router, end to end: real servers on loopback ports, the
official `openai` client, the replicas' pushed KV events, `/metrics` parsed with prometheus_client, replicas
killed for real, and `sage llm serve --replicas 2` as a user starts it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import TierConfig
from sage_infer.hal.net import free_port, listening_pid
from sage_infer.router.fleet import FleetRouter, build_fleet_app
from sage_infer.server.launch import http_server
from tests.server_fixture import running_server, serving
from tests.tiny_models import make_tiny_model

BLOCK = 16
PREFIX = [5 + (13 * j) % 400 for j in range(4 * BLOCK)]  # 4 full blocks a customer's requests share


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fleet") / "tiny-llama", "llama")


@contextmanager
def running_fleet(urls: list[str], routing: str = "kv", api_key: str | None = None):
    """The fleet router in front of running replicas, once it follows every replica's events; (URL, router)."""
    router = FleetRouter(urls, routing, api_key)
    with serving(http_server(build_fleet_app(router), "127.0.0.1", 0)) as url:
        wait_for(lambda: all(link.replica.up for link in router.links.values()), "every replica in the routing")
        yield url, router


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


def complete(url: str, prompt: list[int], api_key: str = "unused", **kw):
    model = client(url, api_key).models.list().data[0].id
    return client(url, api_key).completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                                   extra_body={"ignore_eos": True}, **kw)


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def holds(router: FleetRouter, url: str, blocks: int) -> bool:
    return len(router.index.replica(url).media["device"]) >= blocks


def test_a_shared_prefix_goes_to_the_replica_that_holds_it_and_the_prediction_matches(model_dir):
    with running_server(model_dir) as a, running_server(model_dir) as b, running_fleet([a.url, b.url]) as (url, router):
        first = complete(b.url, PREFIX + [7, 8, 9])  # b computed the prefix (a client that went there directly)
        wait_for(lambda: holds(router, b.url, 4), "b's stored events")
        later = [complete(url, PREFIX + [10 + i, 11, 12]) for i in range(3)]
        assert metric(url, "sage:router_requests_total", instance=b.url) == 3  # every turn went to b, not idle a
        assert [r.usage.prompt_tokens_details.cached_tokens for r in later] == [4 * BLOCK] * 3
        assert metric(url, "sage:router_predicted_cached_tokens_total") == 4 * BLOCK * 3
        assert metric(url, "sage:router_reported_cached_tokens_total") == 4 * BLOCK * 3
        assert metric(url, "sage:router_cached_tokens_abs_error_total") == 0
        assert metric(url, "sage:router_overhead_seconds_count") == 3
        [want] = LLM(str(model_dir), dtype="fp32", num_blocks=64, device="cpu").generate(
            [PREFIX + [7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert first.choices[0].text == want.outputs[0].text
        assert complete(url, PREFIX + [7, 8, 9]).choices[0].text == want.outputs[0].text  # the router changes nothing


def test_streams_pass_through_and_usage_reaches_only_a_client_that_asked(model_dir):
    with running_server(model_dir) as a, running_server(model_dir) as b, running_fleet([a.url, b.url]) as (url, _):
        model = client(url).models.list().data[0].id
        plain = list(client(url).completions.create(model=model, prompt=PREFIX, max_tokens=4, temperature=0,
                                                    stream=True))
        assert all(chunk.usage is None for chunk in plain) and "".join(c.choices[0].text for c in plain)
        asked = list(client(url).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4
        assert metric(url, "sage:router_reported_cached_tokens_total") >= 0  # checked on streams too
        assert metric(url, "sage:router_overhead_seconds_count") == 2


def test_a_replica_pushes_a_snapshot_events_with_their_tier_and_a_heartbeat(model_dir):
    tiers = TierConfig(host_bytes=1 << 20)
    with running_server(model_dir, num_blocks=8, tiers=tiers) as server:
        lines: list[dict] = []
        with httpx.stream("GET", f"{server.url}/v1/kv/events/stream", timeout=10) as reply:
            assert reply.headers["content-type"].startswith("application/x-ndjson")
            for n, line in enumerate(reply.iter_lines()):
                lines.append(json.loads(line))
                if n == 0:
                    assert lines[0]["type"] == "snapshot" and set(lines[0]["blocks"]) == {"device", "host"}
                    for i in range(3):  # 3 prompts of 4 blocks each through an 8-block pool: some are demoted
                        complete(server.url, [i + 1] + PREFIX[1:] + [1])
                events = [e for m in lines if m["type"] == "events" for e in m["events"]]
                if ("stored", "host") in {(op, medium) for op, medium, _ in events} and \
                        any(m["type"] == "load" for m in lines[1:]):
                    break
        assert ["stored", "device"] == events[0][:2]
        assert {"num_running", "num_waiting", "kv_usage"} <= set(next(m for m in lines if m["type"] == "load"))


def test_a_decode_worker_publishes_no_event_stream(model_dir):
    with running_server(model_dir, role="decode") as decode:
        reply = httpx.get(f"{decode.url}/v1/kv/events/stream")
        assert reply.status_code == 404 and "does not publish KV events" in reply.json()["error"]["message"]


def test_the_router_answers_client_routes_with_openai_errors_and_needs_the_key(model_dir):
    with running_server(model_dir, api_key="k") as a, running_fleet([a.url], api_key="k") as (url, _):
        assert httpx.get(f"{url}/version").json()["version"]
        missing = httpx.get(f"{url}/v1/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401
        headers = {"Authorization": "Bearer k"}
        bad = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": -1},
                         headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert httpx.get(f"{url}/health").json()["replicas"] == {"up": 1, "total": 1}  # no addresses without the key
        assert httpx.get(f"{url}/health", headers=headers).json()["replicas"][a.url]["up"] is True
        # every route a client may call on a replica, the router answers too
        replica_routes = httpx.get(f"{a.url}/openapi.json", headers=headers).json()["paths"]
        router_routes = httpx.get(f"{url}/openapi.json", headers=headers).json()["paths"]
        assert {(p, m) for p, ms in replica_routes.items() for m in ms} <= \
            {(p, m) for p, ms in router_routes.items() for m in ms}
        assert httpx.get(f"{url}/openapi.json").status_code == 401
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0).completions.create(
            model=a.model, prompt=PREFIX, max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2


def test_replicas_join_and_leave_a_running_router_only_with_its_key(model_dir):
    headers = {"Authorization": "Bearer k"}
    with running_server(model_dir, api_key="k") as a, running_server(model_dir, api_key="k") as b, \
            running_fleet([a.url], api_key="k") as (url, router):
        admin = f"{url}/v1/router/replicas"
        assert httpx.post(admin, json={"url": b.url}).status_code == 401
        for body, param in (({"url": "ftp://x"}, "url"), ({"url": b.url, "dp": "2"}, "dp"), ({"uri": b.url}, "uri"),
                            ({"url": f"http://127.0.0.1:{free_port()}"}, "url")):
            bad = httpx.post(admin, json=body, headers=headers)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        added = httpx.post(admin, json={"url": b.url}, headers=headers)
        assert added.status_code == 201 and added.json() == {"added": [b.url]}
        assert httpx.post(admin, json={"url": b.url}, headers=headers).status_code == 409
        wait_for(lambda: router.links[b.url].replica.up, "the new replica in the routing")
        complete(a.url, PREFIX + [7], api_key="k")  # a holds the prefix: a new prefix goes to the idle newcomer
        wait_for(lambda: holds(router, a.url, 4), "a's stored events")
        complete(url, [300 + j for j in range(3 * BLOCK)], api_key="k")
        assert metric(url, "sage:router_requests_total", instance=b.url) == 1
        listed = httpx.get(admin, headers=headers).json()["data"]
        assert [(r["name"], r["up"]) for r in listed] == [(a.url, True), (b.url, True)]
        removed = httpx.delete(admin, params={"url": a.url}, headers=headers)
        assert removed.status_code == 200 and removed.json() == {"removed": [a.url]}
        assert httpx.delete(admin, params={"url": a.url}, headers=headers).status_code == 404
        assert httpx.delete(admin, params={"url": b.url}, headers=headers).status_code == 409  # the last one stays
        reply = complete(url, PREFIX + [8], api_key="k")  # a's prefix: only b is left, so b computes it
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(url, "sage:router_requests_total", instance=b.url) == 2
    with running_server(model_dir) as a, running_fleet([a.url]) as (url, _):  # no key: nobody may name a replica
        refused = httpx.post(f"{url}/v1/router/replicas", json={"url": a.url})
        assert refused.status_code == 403 and "--api-key" in refused.json()["error"]["message"]


def start_replica(model_dir, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--model", str(model_dir),
                             "--set", "model.dtype=fp32", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "serving" in line:
            return proc
    raise AssertionError(f"replica on port {port} did not start (exit {proc.wait()})")


def test_a_killed_replica_leaves_the_routing_loses_no_request_and_resyncs_when_it_returns(model_dir):
    ports = [free_port(), free_port()]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda port: start_replica(model_dir, port), ports))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        with running_fleet(urls) as (url, router):
            complete(url, PREFIX + [1])
            owner = next(i for i, u in enumerate(urls) if metric(url, "sage:router_requests_total", instance=u) == 1)
            wait_for(lambda: holds(router, urls[owner], 4), "the owner's stored events")
            procs[owner].send_signal(signal.SIGKILL)
            procs[owner].wait()
            got = complete(url, PREFIX + [2])  # the prefix's replica is gone: another one answers
            assert got.usage.completion_tokens == 6
            wait_for(lambda: not router.links[urls[owner]].replica.up, "the dead replica out of the routing", 5)
            assert len(router.index.replica(urls[owner]).media["device"]) == 0  # its blocks forgotten
            assert httpx.get(f"{url}/health").json()["status"] == "degraded"
            procs[owner] = start_replica(model_dir, ports[owner])  # back, by hand, at the same address
            wait_for(lambda: router.links[urls[owner]].replica.up, "the replica back in the routing")
            assert metric(url, "sage:router_replica_lost_total", instance=urls[owner]) == 1
            assert httpx.get(f"{url}/health").json()["status"] == "ok"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextmanager
def serve_replicas(model_dir, *flags: str, routing: str = "kv"):
    """`sage llm serve --replicas 2 FLAGS` in a subprocess: (router URL, replica URLs, its stderr so far); SIGTERM
    at the end must stop it with exit code 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SAGE_API_KEY", None)
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--replicas", "2",
                             "--routing", routing, *flags, "--port", "0", "--model", str(model_dir),
                             "--set", "model.dtype=fp32"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(rf"at (http://127\.0\.0\.1:\d+)/v1 \(2 replicas, routing {routing}: replica-0 (\S+), "
                          r"replica-1 (\S+)\)", line)
        assert match, f"unexpected first line: {line!r}"
        yield match.group(1), [match.group(2), match.group(3)], stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    stderr.seek(0)
    assert code == 0, stderr.read()[-3000:]


def test_serve_replicas_starts_pinned_replicas_behind_one_url_restarts_a_killed_one_and_stops_them(model_dir):
    with serve_replicas(model_dir, routing="least-load") as (url, replicas, stderr):
        assert complete(url, PREFIX).usage.completion_tokens == 6
        stderr.seek(0)
        assert re.search(r"--replicas 2: replica-0: cores \S+ \(NUMA node \d+\); replica-1: cores", stderr.read())
        killed = _listening_pid(int(replicas[0].rsplit(":", 1)[1]))
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # the command starts it again, at the same URL
            try:
                if httpx.get(f"{replicas[0]}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.5)
        assert _listening_pid(int(replicas[0].rsplit(":", 1)[1])) != killed
        assert all(complete(url, PREFIX).usage.completion_tokens == 6 for _ in range(3))
        stderr.seek(0)
        assert "replica-0 exited (code -9): starting it again on port" in stderr.read()
    for replica in replicas:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{replica}/health", timeout=2)


@pytest.mark.parametrize("argv, message", [
    (["llm", "serve", "--replicas", "0"], "--replicas 0: expected at least 1"),
    (["llm", "serve", "--replicas", "2", "--routing", "closest"], "--routing closest: expected one of kv"),
    (["llm", "serve", "--routing", "random"], "the prefill workers of --pd xPyD: give one"),
    (["llm", "serve", "--pd", "2P1D", "--routing", "closest"], "--routing closest: expected one of kv"),
    (["llm", "router", "--replica", "http://127.0.0.1:9", "--tokenizer", "/nonexistent"], "/nonexistent: model"),
    (["llm", "serve", "--replicas", "4096"], "--replicas 4096: "),
    (["llm", "serve", "--pd", "40P40D"], "--pd 40P40D: 80 workers, and this machine gives"),
    (["llm", "serve", "--replicas", "2", "--pd", "1P1D"], "--pd xPyD already runs x prefill and y decode"),
    (["llm", "router", "--replica", "http://127.0.0.1:9"], "--replica http://127.0.0.1:9: does not answer"),
    (["llm", "router", "--replica", "localhost:9"], "expected an http(s) URL"),
])
def test_bad_fleet_flags_are_one_line_and_exit_2(argv, message):
    result = subprocess.run([sys.executable, "-m", "sage_infer.cli.main", *argv], capture_output=True, text=True,
                            timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


def test_the_router_hashes_prompts_exactly_as_the_replica_does(model_dir):
    """Token ids as given; text and chat messages tokenized in the router by the served model's tokenizer and chat
    template (`--tokenizer`, implied by `--replicas`): the same hashes the replica names its blocks by."""
    from sage_infer.kv_policy.routing import Request
    from sage_infer.router.local_prompts import local_prompts

    text = " ".join(f"word{i}" for i in range(60))
    chat = [{"role": "system", "content": text}, {"role": "user", "content": "and a question?"}]
    with running_server(model_dir) as a, running_fleet([a.url]) as (_, router):
        assert not router.hash_here({"prompt": text}, Request(0))  # no tokenizer here: the replica is asked
        router.prompts = local_prompts(str(model_dir))
        bodies = [{"prompt": PREFIX + [1, 2, 3]}, {"prompt": PREFIX, "cache_salt": "tenant-a"}, {"prompt": text},
                  {"messages": chat}, {"messages": chat, "cache_salt": "tenant-b", "add_generation_prompt": False}]
        for body in bodies:
            described = Request(0)
            assert router.hash_here(body, described), body
            asked = httpx.post(f"{a.url}/v1/kv/hashes", json=body).json()
            assert described.hashes == asked["hashes"] and len(described.hashes) >= 3, body
            assert (described.prompt_tokens, described.tokens_per_block) == (asked["prompt_tokens"],
                                                                             asked["tokens_per_hash"])
        # a prompt the replica would refuse is left to it: it answers the client
        assert not router.hash_here({"prompt": "x" * 10_000_000}, Request(0))
    assert local_prompts(str(model_dir / "missing")) is None  # not readable here: route by asking


def _listening_pid(port: int) -> int:
    pid = listening_pid(port)
    assert pid is not None, f"nothing listens on port {port}"
    return pid


def _serve_pid(port: int) -> int:
    """The pid of the `sage llm serve` listening on `port` (its command line names the port)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                return int(entry)
    raise AssertionError(f"no sage llm serve on port {port}")


def test_replicas_on_ray_come_back_after_their_server_is_killed(model_dir):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'sage-infer[ray]'): --launcher ray untested")
    with serve_replicas(model_dir, "--launcher", "ray") as (url, replicas, _):
        assert complete(url, PREFIX).usage.completion_tokens == 6
        os.kill(_serve_pid(int(replicas[0].rsplit(":", 1)[1])), signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "degraded", "the router to drop it", 10)
        assert complete(url, PREFIX + [1]).usage.completion_tokens == 6  # the other replica serves meanwhile
        wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "ok", "Ray to restart it", 120)
        assert httpx.get(f"{replicas[0]}/health").status_code == 200  # back at the same address


def test_a_prefix_written_through_to_the_shared_tier_is_every_replicas(model_dir):
    from tests.redis_fixture import start_redis

    redis = start_redis()
    tiers = TierConfig(remote_url=redis.url, remote_write_policy="write_through")
    try:
        with running_server(model_dir, tiers=tiers) as a, running_server(model_dir, tiers=tiers) as b, \
                running_fleet([a.url, b.url]) as (url, router):
            complete(a.url, PREFIX + [1])  # a computes the prefix and writes it through to Redis at once
            wait_for(lambda: len(router.index.shared) >= 4, "a's remote-tier events")
            hashes = httpx.post(f"{b.url}/v1/kv/hashes", json={"prompt": PREFIX + [2]}).json()["hashes"]
            assert router.index.hit(router.index.replica(b.url), hashes).lower_blocks == (("remote", 4),)
            got = complete(b.url, PREFIX + [2])  # b never computed it: it loads a's blocks from the shared tier
            assert got.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
    finally:
        redis.kill()


def test_remote_write_through_needs_a_remote_tier():
    with pytest.raises(ValueError, match="remote_write_policy write_through writes blocks to the remote tier"):
        TierConfig(remote_write_policy="write_through")


def test_a_stream_whose_replica_dies_before_its_first_token_is_sent_to_another(model_dir):
    """A replica that accepted a streamed chat (its status line and opening role chunk sent) and then died: the
    client has seen nothing yet, so the router sends the request to another replica instead of failing it. The dying
    replica is a stand-in that breaks its connection there, as a killed process does."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    dying = FastAPI()

    @dying.get("/health")
    async def health():
        return {"status": "ok"}

    @dying.get("/v1/kv/events/stream")
    async def no_events():
        return JSONResponse({"error": {"message": "no events"}}, status_code=404)

    @dying.post("/v1/chat/completions")
    async def chat():
        async def events():
            yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
            raise RuntimeError("the process died")
        return StreamingResponse(events(), media_type="text/event-stream")

    with running_server(model_dir) as a, serving(http_server(dying, "127.0.0.1", 0)) as stand_in, \
            running_fleet([stand_in, a.url], routing="round-robin") as (url, router):
        for i in range(2):  # round-robin: one of them is sent to the stand-in first
            stream = client(url).chat.completions.create(
                model=a.model, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=3, stream=True)
            chunks = list(stream)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # the answer came whole
        assert metric(url, "sage:router_retries_total") >= 1
        assert metric(url, "sage:router_requests_total", instance=a.url) >= 2
