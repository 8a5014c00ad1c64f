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
