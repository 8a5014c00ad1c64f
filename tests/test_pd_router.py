"""Prefill/decode separation end to end: a prefill worker, a decode worker and the router, each a real
server on a loopback port, driven with the official `openai` client.

Greedy outputs through the router equal one colocated server's, streaming or not, completions and
chat, with stop strings, n > 1 and cache_salt; the decode worker's prompt KV came over the
transport (cached tokens); both pools are clean afterwards; failures are clear.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import running_router, running_server
from tests.tiny_models import make_tiny_model

BLOCK = 16  # the fixture's KVPoolConfig default block size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pd-router") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def colocated(model_dir):
    with running_server(model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def deployment(model_dir):
    """1P1D over shm, behind the router."""
    with running_server(model_dir, role="prefill") as prefill, running_server(model_dir, role="decode") as decode:
        with running_router([prefill.url], [decode.url]) as url:
            yield prefill, decode, url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


PROMPT = [5 + (13 * j) % 400 for j in range(3 * BLOCK + 5)]  # 3 full blocks and 5 tokens


def complete(url: str, model: str, prompt: list[int] = PROMPT, **kw):
    return client(url).completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw)


def settle(*servers) -> None:
    """Wait until no request is in flight and no KV is held, then check both pools for leaks."""
    deadline = time.monotonic() + 20
    for server in servers:
        engine = server.backend.engine
        while server.backend.num_in_flight or engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests or held KV did not drain"
            time.sleep(0.02)
        engine.kv.block_manager.check_invariants()


def test_completions_through_the_router_equal_colocated_and_reuse_the_prefill_kv(deployment, colocated):
    prefill, decode, url = deployment
    want = complete(colocated.url, colocated.model)
    got = complete(url, decode.model)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # every full block came from prefill
    settle(prefill, decode)
    stats = prefill.backend.engine.kv.source("transfers").transfers.stats
    assert stats.sent >= 1 and stats.send_failures == 0
    assert prefill.backend.engine.kv.block_manager.num_used_blocks == 0  # freed after the ack


def test_streaming_chat_stop_strings_n_and_salt_match_colocated(deployment, colocated):
    prefill, decode, url = deployment
    messages = [{"role": "user", "content": "To be, or not to be, that is the question: whether 'tis nobler"}]

    def chat(target: str, model: str, **kw) -> list[str]:
        stream = client(target).chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                        temperature=0, stream=True, **kw)
        texts: dict[int, str] = {}
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        return [texts[i] for i in sorted(texts)]

    assert chat(url, decode.model) == chat(colocated.url, colocated.model)
    assert chat(url, decode.model, n=2) == chat(colocated.url, colocated.model, n=2)
    salted = {"extra_body": {"cache_salt": "tenant-a"}}
    assert chat(url, decode.model, **salted) == chat(colocated.url, colocated.model, **salted)
    want = complete(colocated.url, colocated.model, stop=["e"])
    got = complete(url, decode.model, stop=["e"])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.choices[0].text, want.choices[0].finish_reason)
    settle(prefill, decode)


def test_several_prompts_go_to_the_decode_worker_whole(deployment, colocated):
    prefill, decode, url = deployment
    prompts = ["The quality of mercy", "Friends, Romans, countrymen"]
    kw = dict(prompt=prompts, max_tokens=5, temperature=0)
    got = client(url).completions.create(model=decode.model, **kw)
    want = client(colocated.url).completions.create(model=colocated.model, **kw)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    assert families["sage:router_colocated"].samples[0].value >= 1
    settle(prefill, decode)


def test_clients_cannot_set_kv_transfer_params_and_bad_requests_pass_through(deployment):
    _, decode, url = deployment
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        complete(url, decode.model, extra={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(url, "no-such-model")
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_worker_without_the_role_refuses_transfer_params(colocated):
    with pytest.raises(openai.BadRequestError, match="role is both"):
        complete(colocated.url, colocated.model, extra={"kv_transfer_params": {"do_remote_decode": True}})
    reply = httpx.post(f"{colocated.url}/v1/kv/send",
                       json={"request_id": "x", "address": "shm:///tmp/x", "transfer_id": "t"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == 404


def test_without_a_prefill_worker_the_decode_worker_computes_the_prompt(model_dir, colocated):
    with running_server(model_dir, role="decode") as decode:
        with running_router(["http://127.0.0.1:9"], [decode.url]) as url:  # port 9: nothing listens
            got = complete(url, decode.model)
            assert got.choices[0].text == complete(colocated.url, colocated.model).choices[0].text
            assert got.usage.prompt_tokens_details.cached_tokens == 0
            health = httpx.get(f"{url}/health").json()
            assert health["status"] == "degraded" and health["workers"]["http://127.0.0.1:9"]["up"] is False
        settle(decode)


def test_kv_the_prefill_worker_does_not_hold_costs_a_recompute_at_once(deployment, colocated):
    prefill, decode, _ = deployment
    failures = decode.backend.engine.kv.source("transfers").transfers.stats.receive_failures
    params = {"remote_url": prefill.url, "remote_request_id": "cmpl-nobody-0",
              "schema_digest": prefill.backend.kv_transfer_info().schema_digest}
    fresh = [7 + (29 * j) % 400 for j in range(3 * BLOCK + 5)]  # not in the decode worker's prefix cache
    got = complete(decode.url, decode.model, fresh, extra={"kv_transfer_params": params})
    assert got.choices[0].text == complete(colocated.url, colocated.model, fresh).choices[0].text
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    received = decode.backend.engine.kv.source("transfers").transfers
    assert received.stats.receive_failures == failures + 1  # gave up on the 404
    settle(prefill, decode)


def test_a_decode_worker_refuses_kv_in_another_format(deployment):
    prefill, decode, _ = deployment
    params = {"remote_url": prefill.url, "remote_request_id": "x", "schema_digest": "0" * 32}
    with pytest.raises(openai.BadRequestError, match="schema_digest"):
        complete(decode.url, decode.model, extra={"kv_transfer_params": params})


def test_a_decode_worker_in_int8_kv_takes_a_fp32_prefill_workers_kv_converted(model_dir):
    with running_server(model_dir, role="prefill") as prefill, \
            running_server(model_dir, role="decode", kv_dtype="int8") as decode, \
            running_server(model_dir, kv_dtype="int8") as int8_colocated, \
            running_router([prefill.url], [decode.url]) as url:
        got = complete(url, decode.model)
        assert got.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # converted, verified, taken
        assert got.usage.completion_tokens == 8
        # the same tokens as a server keeping int8 KV itself (its prompt blocks are the same codes)
        assert got.choices[0].text == complete(int8_colocated.url, int8_colocated.model).choices[0].text
        stats = decode.backend.engine.kv.source("transfers").transfers.stats
        assert stats.received == 1 and stats.hash_mismatches == 0
        settle(prefill, decode)


def test_the_router_sends_a_prompt_to_the_prefill_worker_that_holds_its_prefix(model_dir, colocated):
    with running_server(model_dir, role="prefill") as p0, running_server(model_dir, role="prefill") as p1, \
            running_server(model_dir, role="decode") as decode:
        prompt = [9 + (17 * j) % 400 for j in range(4 * BLOCK + 2)]
        complete(p1.url, p1.model, prompt)  # p1 computed this prompt before: its blocks are cached there
        match = httpx.post(f"{p1.url}/v1/kv/match", json={"prompt": prompt}).json()
        assert match["cached_tokens"] == 4 * BLOCK and match["prompt_tokens"] == len(prompt)
        hashes = httpx.post(f"{p0.url}/v1/kv/hashes", json={"prompt": prompt}).json()["hashes"]
        events = httpx.get(f"{p1.url}/v1/kv/events", params={"since": 0}).json()
        assert [f"+{h}" for h in hashes] == events["events"][:4]  # p1 published those blocks as stored
        with running_router([p0.url, p1.url], [decode.url]) as url:
            def view() -> dict:
                families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
                return {s.labels["instance"]: s.value for s in families["sage:router_replica_blocks"].samples
                        if s.labels["medium"] == "device"}

            deadline = time.monotonic() + 10
            while view().get(p1.url, 0) < 4:  # the router's view of p1 caught up with its events
                assert time.monotonic() < deadline
                time.sleep(0.05)
            got = complete(url, decode.model, prompt)
            assert got.choices[0].text == complete(colocated.url, colocated.model, prompt).choices[0].text
            assert got.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
            routed = {(s.labels["instance"], s.labels["role"]): s.value
                      for s in families["sage:router_requests"].samples if s.name.endswith("_total")}
            assert routed.get((p1.url, "prefill")) == 1 and (p0.url, "prefill") not in routed
            overlap = families["sage:router_overlap_tokens"].samples[0].value
            assert overlap == 4 * BLOCK and families["sage:router_prompt_tokens"].samples[0].value == len(prompt)
            # the prefill worker reported the cached tokens the router predicted (its pushed events, every tier)
            assert families["sage:router_cached_tokens_abs_error"].samples[0].value == 0
            assert families["sage:router_reported_cached_tokens"].samples[0].value == 4 * BLOCK
        settle(p0, p1, decode)


@pytest.mark.parametrize("routing", ["round-robin", "session"])
def test_the_simple_policies_choose_the_prefill_worker_too(model_dir, colocated, routing):
    with running_server(model_dir, role="prefill") as p0, running_server(model_dir, role="prefill") as p1, \
            running_server(model_dir, role="decode") as decode:
        with running_router([p0.url, p1.url], [decode.url], routing=routing) as url:
            texts = [complete(url, decode.model, PROMPT, user="customer-7").choices[0].text for _ in range(4)]
            assert set(texts) == {complete(colocated.url, colocated.model, PROMPT).choices[0].text}
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
            routed = {s.labels["instance"]: s.value for s in families["sage:router_requests"].samples
                      if s.name.endswith("_total") and s.labels["role"] == "prefill"}
            # round-robin alternates; session keeps one customer (its `user`) on one prefill worker
            assert sorted(routed.values()) == ([2.0, 2.0] if routing == "round-robin" else [4.0])
        settle(p0, p1, decode)


def test_workers_report_their_transfers_in_metrics(deployment):
    prefill, decode, url = deployment
    complete(url, decode.model, [3 + (5 * j) % 400 for j in range(2 * BLOCK + 1)])
    settle(prefill, decode)

    def samples(server) -> dict:
        text = httpx.get(f"{server.url}/metrics").text
        return {(s.name, s.labels.get("direction"), s.labels.get("outcome")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("sage:pd_")}

    sent, received = samples(prefill), samples(decode)
    assert sent["sage:pd_transfers_total", "send", "ok"] >= 1 and sent["sage:pd_transfers_total", "send", "failed"] == 0
    assert received["sage:pd_transfers_total", "receive", "ok"] >= 1
    assert sent["sage:pd_transfer_bytes_total", "send", None] == received["sage:pd_transfer_bytes_total", "receive",
                                                                          None] > 0


@pytest.mark.parametrize("strategy, fields, first", [
    ("priority", ({"priority": 5}, {"priority": 1}), 1),  # lower priority value goes first
    ("slo", ({"slo_ttft_ms": 60_000}, {"slo_ttft_ms": 1}), 1),  # the tighter TTFT deadline goes first
    ("fifo", ({"priority": 5}, {"priority": 1}), 0),  # arrival order, whatever else they say
])
def test_requests_waiting_for_a_decode_slot_go_in_the_strategys_order(deployment, strategy, fields, first):
    import threading

    from sage_infer.config.serve import RouterConfig

    prefill, decode, _ = deployment
    config = RouterConfig(strategy=strategy, max_outstanding_per_worker=1)
    with running_router([prefill.url], [decode.url], config=config) as url:
        body = {"model": decode.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        finished: list[int] = []

        def send(i: int | None, extra: dict, max_tokens: int = 4) -> None:
            httpx.post(f"{url}/v1/completions", timeout=120,
                       json={**body, "prompt": [40 + (i or 0)] * 20, "max_tokens": max_tokens, **extra})
            if i is not None:
                finished.append(i)

        def router_waiting() -> float:
            text = httpx.get(f"{url}/metrics").text
            return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                        if s.name == "sage:router_waiting")

        def until(condition, what: str) -> None:
            deadline = time.monotonic() + 30
            while not condition():
                assert time.monotonic() < deadline, what
                time.sleep(0.01)

        blocker = threading.Thread(target=send, args=(None, {}, 480))  # holds the only slot for a while
        blocker.start()
        until(lambda: decode.backend.num_in_flight > 0, "the blocker never reached the decode worker")
        waiting = []
        for i, extra in enumerate(fields):  # arrival order: 0 then 1, each queued before the next is sent
            waiting.append(threading.Thread(target=send, args=(i, extra)))
            waiting[-1].start()
            until(lambda queued=i + 1: router_waiting() == queued or not blocker.is_alive(), "the request never queued")
        assert blocker.is_alive(), "the blocker finished before both requests queued: the order was not tested"
        for thread in (blocker, *waiting):
            thread.join(120)
        assert finished[0] == first
    settle(prefill, decode)


def test_with_an_api_key_the_router_and_the_pull_between_workers_need_it(model_dir, colocated):
    key = "deployment-key"
    with running_server(model_dir, role="prefill", api_key=key) as prefill, \
            running_server(model_dir, role="decode", api_key=key) as decode, \
            running_router([prefill.url], [decode.url], api_key=key) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url).completions.create(model=decode.model, prompt=PROMPT, max_tokens=2)
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        got = keyed.completions.create(model=decode.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert got.choices[0].text == complete(colocated.url, colocated.model).choices[0].text
        assert got.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # the keyed pull worked
        send = httpx.post(f"{prefill.url}/v1/kv/send", json={"request_id": "x", "address": "shm:///x",
                                                              "transfer_id": "t"})
        assert send.status_code == 401  # nobody without the key can ask a prefill worker for KV
        public = httpx.get(f"{url}/health").json()  # the state, but no worker address, without the key
        assert public == {"status": "ok", "workers": {"prefill": {"up": 1, "total": 1},
                                                      "decode": {"up": 1, "total": 1}}}
        assert prefill.url not in json.dumps(public) and decode.url not in json.dumps(public)
        private = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {key}"}).json()
        assert private["workers"][decode.url] == {"role": "decode", "up": True}
        settle(prefill, decode)


def test_a_decode_worker_never_sends_the_key_to_a_url_its_router_did_not_sign(model_dir):
    """A client holding the key, talking to a decode worker directly, names a remote_url of its own: the worker
    refuses (403) and nothing reaches that address."""
    key, received = "deployment-key", []

    class Listener(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            received.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    listener = http.server.HTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    try:
        with running_server(model_dir, role="decode", api_key=key) as decode:
            body = {"model": decode.model, "prompt": PROMPT, "max_tokens": 2,
                    "kv_transfer_params": {"remote_url": f"http://127.0.0.1:{listener.server_port}/anything",
                                           "remote_request_id": "zz"}}
            reply = httpx.post(f"{decode.url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert reply.status_code == 403 and "not signed by this deployment's router" in reply.text
            forged = {**body["kv_transfer_params"], "signature": "0" * 64}
            reply = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": forged},
                               headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert reply.status_code == 403
    finally:
        listener.shutdown()
    assert received == []


def test_behind_a_proxy_that_does_not_sign_a_decode_worker_pulls_only_from_its_allowed_peers(model_dir, colocated):
    """`kv_transport.allowed_peers` names the prefill instances a decode worker may pull from unsigned (a proxy of
    another project splits the request): a listed one works with the key and without a signature; with a list
    set, an unlisted URL is refused even on a deployment without a key."""
    key = "deployment-key"
    auth = {"Authorization": f"Bearer {key}"}
    with running_server(model_dir, role="prefill", api_key=key) as prefill:
        peers = {"allowed_peers": [prefill.url + "/"]}  # (another spelling of the same origin)
        with running_server(model_dir, role="decode", api_key=key, kv_transport=peers) as decode:
            held = httpx.post(f"{prefill.url}/v1/completions", headers=auth, timeout=60, json={
                "model": prefill.model, "prompt": PROMPT, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
            body = {"model": decode.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "kv_transfer_params": {**held, "remote_url": prefill.url}}  # no signature
            reply = httpx.post(f"{decode.url}/v1/completions", json=body, headers=auth, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
            assert reply.json()["choices"][0]["text"] == complete(colocated.url, colocated.model).choices[0].text
            elsewhere = {**body["kv_transfer_params"], "remote_url": "http://127.0.0.1:9/x"}
            reply = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": elsewhere},
                               headers=auth, timeout=60)
            assert reply.status_code == 403 and "allowed_peers" in reply.text
    with running_server(model_dir, role="decode", kv_transport={"allowed_peers": ["http://10.0.0.1:8100"]}) as decode:
        body = {"model": decode.model, "prompt": PROMPT, "max_tokens": 2,
                "kv_transfer_params": {"remote_url": "http://127.0.0.1:9/x", "remote_request_id": "zz"}}
        reply = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 403 and "not in kv_transport.allowed_peers" in reply.text


def test_allowed_peers_are_http_origins():
    from pydantic import ValidationError

    from sage_infer.config.transport import KVTransportConfig

    config = KVTransportConfig(allowed_peers=["http://Prefill-0:8100/", "https://10.0.0.2", "http://[::1]:81/v1"])
    assert config.allowed_peers == ["http://prefill-0:8100", "https://10.0.0.2:443", "http://[::1]:81"]
    for bad in ("10.0.0.1:8100", "ftp://x:1", "http://:80", "http://x:99999"):
        with pytest.raises(ValidationError, match="allowed_peers"):
            KVTransportConfig(allowed_peers=[bad])


def test_kv_events_answers_in_order_and_refuses_a_bad_cursor(deployment):
    prefill, decode, url = deployment
    first = httpx.get(f"{prefill.url}/v1/kv/events", params={"since": -1}).json()
    assert first["reset"] is True  # a reader starting over gets the whole current set
    later = httpx.get(f"{prefill.url}/v1/kv/events", params={"since": first["next"]}).json()
    assert later["reset"] is False and later["next"] >= first["next"]
    bad = httpx.get(f"{prefill.url}/v1/kv/events", params={"since": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    assert httpx.get(f"{decode.url}/v1/kv/events").status_code == 404  # only prefill workers publish


def test_a_prompt_shorter_than_one_block_goes_through_the_router_too(deployment, colocated):
    prefill, decode, url = deployment
    short_prompt = [7, 8, 9]  # no full KV block: nothing to hold or send, the decode worker computes it
    got = complete(url, decode.model, short_prompt)
    assert got.choices[0].text == complete(colocated.url, colocated.model, short_prompt).choices[0].text
    settle(prefill, decode)
    assert not prefill.backend.engine.kv.source("transfers").transfers.held


def test_slo_strategy_measures_decode_tpot_and_counts_the_targets_met(deployment):
    """Under strategy slo the router measures each decode worker's seconds per output token (from the streams
    it relays and the calls it makes), exports it, and counts which TTFT/TPOT targets requests met."""
    from sage_infer.config.serve import RouterConfig

    prefill, decode, _ = deployment
    with running_router([prefill.url], [decode.url], config=RouterConfig(strategy="slo")) as url:
        for i in range(2):
            stream = client(url).completions.create(
                model=decode.model, prompt=[60 + i] * 40, max_tokens=12, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "slo_tpot_ms": 60_000, "slo_ttft_ms": 60_000})
            assert sum(len(c.choices[0].text) > 0 for c in stream if c.choices) >= 1
        complete(url, decode.model, extra={"slo_tpot_ms": 0.001})  # no worker can meet this: counted as missed
        bad = httpx.post(f"{url}/v1/completions", json={"model": decode.model, "prompt": [1, 2], "slo_tpot_ms": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "slo_tpot_ms"
        samples = {(s.name, s.labels.get("target"), s.labels.get("met")): s.value
                   for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in f.samples}
    assert samples["sage:router_tpot_seconds", None, None] > 0
    assert samples["sage:router_slo_requests_total", "ttft", "true"] == 2
    assert samples["sage:router_slo_requests_total", "tpot", "true"] == 2
    assert samples["sage:router_slo_requests_total", "tpot", "false"] == 1
    settle(prefill, decode)


def test_the_usage_event_the_router_asks_for_reaches_only_clients_that_asked(deployment):
    """The router asks decode workers for the stream's usage (its token count measures TPOT however the worker
    groups tokens into events); a client that did not ask never sees that event, one that did gets it once."""
    prefill, decode, _ = deployment
    with running_router([prefill.url], [decode.url]) as url:
        for asked in (False, True):
            options = {"stream_options": {"include_usage": True}} if asked else {}
            chunks = list(client(url).completions.create(
                model=decode.model, prompt=[70] * 20, max_tokens=6, temperature=0, stream=True,
                extra_body={"ignore_eos": True}, **options))
            usages = [c.usage for c in chunks if c.usage is not None]
            assert all(c.choices for c in chunks if c.usage is None)
            assert [u.completion_tokens for u in usages] == ([6] if asked else [])
    settle(prefill, decode)


def test_a_tpot_target_steers_away_from_a_decode_worker_measured_too_slow():
    from sage_infer.router.instances import Instances

    workers = Instances.of([], ["http://a", "http://b", "http://c"])
    a, b, c = workers.decode
    a.observe_tpot(0.050)
    b.observe_tpot(0.020)
    b.outstanding = 3  # c is not measured yet: it may meet the target, and is the least loaded
    assert workers.pick("decode", tpot_target=0.030) is c
    c.observe_tpot(0.040)
    assert workers.pick("decode", tpot_target=0.030) is b  # the only one measured fast enough, though busier
    assert workers.pick("decode", tpot_target=0.010) is b  # none meets it: the fastest
    assert workers.pick("decode") is a  # without a target: load alone
    a.observe_tpot(0.010)  # a moving average: one fast request does not make it fast at once
    assert 0.010 < a.tpot_s < 0.050


def test_slo_targets_come_from_the_request_or_the_router_defaults():
    from sage_infer.config.serve import RouterConfig
    from sage_infer.router.admission import Admission

    slo = Admission(RouterConfig(strategy="slo", default_slo_ttft_ms=500, default_slo_tpot_ms=40), 1)
    assert slo.slo({}, 10.0) == slo.slo({"slo_ttft_ms": 500, "slo_tpot_ms": 40}, 10.0)
    assert (slo.slo({}, 10.0).ttft_s, slo.slo({}, 10.0).tpot_s) == (0.5, 0.04)
    assert slo.slo({"slo_tpot_ms": 25}, 10.0).tpot_s == 0.025
    fifo = Admission(RouterConfig(), 1)
    assert fifo.slo({"slo_tpot_ms": 25}, 10.0).tpot_s is None  # targets apply under strategy slo only


def test_a_lone_surrogate_in_a_prompt_gets_a_400_through_the_router_too(deployment):
    """The router forwards the body as the client sent it (escaped JSON), so the worker answers the bad text
    with its 400 instead of the router failing to encode it (a 500)."""
    *_, url = deployment
    for body in ({"prompt": "a \ud800 b"}, {"messages": [{"role": "user", "content": "\ud800"}]}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        reply = httpx.post(f"{url}{path}", content=json.dumps({"model": "any", "max_tokens": 2, **body}),
                           headers={"Content-Type": "application/json"}, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == 400


def test_a_body_the_workers_refuse_gets_its_400_at_the_router_with_nothing_held_on_the_prefill_worker(deployment):
    """The router sends the prefill step with max_tokens 1 and n 1, so unless it checks the whole body first a bad
    max_tokens, n or stream passes the prefill worker, whose KV then waits out its transfer deadline for a decode
    worker that answered 400."""
    prefill, decode, url = deployment
    for bad in ({"max_tokens": 0}, {"n": 17}, {"stream": "maybe"}, {"temperature": -1}):
        reply = httpx.post(f"{url}/v1/completions",
                           json={"model": decode.model, "prompt": [5, 6, 7], "max_tokens": 2, **bad}, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == next(iter(bad)), reply.text
        assert not prefill.backend.engine.has_unfinished_requests()


def test_the_router_answers_version_and_an_unknown_path_with_an_openai_404(deployment):
    _, _, url = deployment
    assert httpx.get(f"{url}/version").json()["version"]
    missing = httpx.get(f"{url}/v1/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
