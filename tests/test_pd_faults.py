"""Prefill/decode faults with real worker processes: a decode worker killed during a request ends
that request with an OpenAI-style error (never a hang), the router marks it down and answers 503
while no decode worker is left, and the prefill worker frees the KV it held for it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import running_router
from tests.tiny_models import make_tiny_model

READY = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pd-faults") / "tiny", "llama")


def worker(model_dir, role: str, *extra: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SAGE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--model", str(model_dir),
                             "--set", "model.dtype=fp32", "--role", role, "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        match = READY.search(line)
        if match:
            return proc, match.group(1)
    raise RuntimeError(f"the {role} worker exited before it served")


def held_blocks(url: str) -> float:
    """KV blocks in use on a worker (held KV counts): sage:kv_cache_usage_perc x blocks is enough to see 0."""
    text = httpx.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "sage:kv_cache_usage_perc")


def test_a_decode_worker_killed_mid_request_ends_it_with_an_error_and_frees_the_prefill_kv(model_dir):
    prefill, p_url = worker(model_dir, "prefill", "--kv-transport", "timeout-s=2")  # held KV lives 2 s
    decode, d_url = worker(model_dir, "decode")
    try:
        with running_router([p_url], [d_url]) as url:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": [5 + (3 * j) % 400 for j in range(40)], "max_tokens": 400,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            events = []
            started = time.monotonic()
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 3:
                        decode.send_signal(signal.SIGKILL)  # mid-generation
            assert time.monotonic() - started < 60
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 503 and "stopped during the request" in error["message"]

            reply = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=30)
            assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["workers"][d_url]["up"] is False

            deadline = time.monotonic() + 30  # nothing of either request stays held on the prefill worker
            while held_blocks(p_url) > 0:
                assert time.monotonic() < deadline, "the prefill worker still holds KV"
                time.sleep(0.2)
    finally:
        for proc in (prefill, decode):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(30)


RECEIVER = """
import os, sys, time
from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime.kv_pipe import KVPipe
schema = KVCacheSchema(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype=KVDtype.FP32)
connector = KVPipe(schema, KVTransportConfig(), backend="tcp", listen=True)
print(connector.address, flush=True)
while connector.dropped_chunks == 0:  # the first chunk of a transfer it never expected: die mid-transfer
    time.sleep(0.001)
os._exit(9)
"""


def test_a_receiver_killed_mid_transfer_fails_the_send_and_the_prefill_frees_its_kv(model_dir):
    """The prefill worker sends in 4 KiB chunks to a receiver process that dies after the first one lands:
    `/v1/kv/send` answers an error instead of hanging, the held KV is freed, and the worker serves on."""
    prefill, p_url = worker(model_dir, "prefill", "--kv-transport", "backend=tcp", "--kv-transport",
                            "chunk-size=4KiB", "--kv-transport", "max-inflight=1", "--kv-transport", "timeout-s=20")
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        address = receiver.stdout.readline().strip()
        assert address.startswith("tcp://")
        model = httpx.get(f"{p_url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [5 + (7 * j) % 400 for j in range(200)], "max_tokens": 1,
                "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
        held = httpx.post(f"{p_url}/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
        assert held_blocks(p_url) > 0
        send = {"request_id": held["remote_request_id"], "address": address, "transfer_id": "killed-mid-transfer"}
        reply = httpx.post(f"{p_url}/v1/kv/send", json=send, timeout=60)
        assert receiver.wait(30) == 9  # it did die after a chunk landed, before the transfer finished
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
        deadline = time.monotonic() + 30
        while held_blocks(p_url) > 0:
            assert time.monotonic() < deadline, "the prefill worker still holds the KV of the failed send"
            time.sleep(0.1)
        failed = next(s.value for f in text_string_to_metric_families(httpx.get(f"{p_url}/metrics").text)
                      for s in f.samples if s.name == "sage:pd_transfers_total"
                      and (s.labels["direction"], s.labels["outcome"]) == ("send", "failed"))
        assert failed == 1
        again = httpx.post(f"{p_url}/v1/completions", json={**body, "kv_transfer_params": None}, timeout=60)
        assert again.status_code == 200  # the worker serves on
    finally:
        for proc in (prefill, receiver):
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def test_a_request_whose_decode_worker_is_gone_is_retried_on_another_one(model_dir):
    with ThreadPoolExecutor(3) as pool:  # started together: start-up is mostly waiting on imports and files
        started = list(pool.map(lambda role: worker(model_dir, role), ("prefill", "decode", "decode")))
    (prefill, p_url), (gone, gone_url), (alive, alive_url) = started
    try:
        gone.kill()
        gone.wait(30)
        model = httpx.get(f"{alive_url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [5 + (11 * j) % 400 for j in range(40)], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        want = httpx.post(f"{alive_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        for stream in (False, True):
            with running_router([p_url], [gone_url, alive_url]) as url:  # a fresh router picks the dead one first
                reply = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=60)
                assert reply.status_code == 200
                if stream:
                    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
                    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
                else:
                    assert reply.json()["choices"][0]["text"] == want
                samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                           for s in f.samples}
                assert samples["sage:router_decode_retries_total"] == 1
                assert samples["sage:router_colocated_total"] == 0  # the prefill worker's KV was used
    finally:
        for proc in (prefill, gone, alive):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(30)
