"""`sage llm serve --pd 1P1D`: one command starts a router and its workers and prints one URL; the
answers through it equal one engine's, structured outputs included (the decode worker constrains); SIGTERM stops
all three processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
import jsonschema
import openai
import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.router.launch import parse_pd
from tests.tiny_models import make_tiny_model

PROMPT = [5 + (11 * j) % 400 for j in range(40)]  # 2 full blocks of 16 and 8 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pd-launch") / "tiny", "llama")


def run_deployment(model_dir, *extra: str, check_workers: Callable[[str, str], None] | None = None,
                   inspect=None, check_router: Callable[[openai.OpenAI, str], None] | None = None) -> str:
    """`sage llm serve --pd 1P1D ...` in a subprocess: one printed URL, answers equal to one engine's, the
    prompt's KV through the decode worker; SIGTERM stops it (exit 0) and its workers. `check_workers(prefill
    URL, decode URL)` looks at the workers before they stop. Returns what the command wrote to stderr (its
    workers' output). `check_router(client, model)` asks the router more."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SAGE_API_KEY", None)
    argv = ["llm", "serve", "--pd", "1P1D", *extra, "--port", "0", "--model", str(model_dir),
            "--set", "model.dtype=fp32"]
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", *argv],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1 \(1 prefill \+ 1 decode workers: prefill-0 (\S+), "
                          r"decode-0 (\S+)\)", line)
        assert match, f"unexpected first line: {line!r}"
        url, workers = match.group(1), [match.group(2), match.group(3)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        [want] = LLM(str(model_dir), dtype="fp32", num_blocks=64, device="cpu").generate(
            [PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert got.choices[0].text == want.outputs[0].text
        assert got.usage.prompt_tokens_details.cached_tokens == 32  # the decode worker got both blocks
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        if check_workers is not None:
            check_workers(*workers)
        if check_router is not None:
            check_router(client, model)
        if inspect is not None:
            inspect(proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    assert code == 0
    deadline = time.monotonic() + 30
    for worker in workers:  # the workers are gone too
        while True:
            try:
                httpx.get(f"{worker}/health", timeout=1)
            except httpx.HTTPError:
                break
            assert time.monotonic() < deadline, f"worker {worker} still answers after the router stopped"
            time.sleep(0.2)
    stderr.seek(0)
    return stderr.read()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "role": {"enum": ["king", "fool"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


def structured_outputs_are_honoured(client: openai.OpenAI, model: str) -> None:
    """A json_schema response_format through the router: the decode worker constrains every token it samples (the
    prefill worker's one token is not part of the answer), streamed or not; a schema the grammar library cannot
    compile is a 400 naming the field."""
    answer = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Who enters?"}]
    reply = client.chat.completions.create(model=model, messages=ask, max_tokens=48, temperature=0,
                                           response_format=answer)
    assert reply.choices[0].finish_reason == "stop"  # the grammar completed within the token limit
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model=model, messages=ask, max_tokens=48, temperature=0.8, seed=5,
                                            response_format=answer, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), PERSON)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"


def test_pd_1p1d_serves_one_url_and_stops_its_workers(model_dir):
    run_deployment(model_dir, check_router=structured_outputs_are_honoured)


def worker_processes(parent: int) -> list[tuple[str, dict[str, str]]]:
    """(command line, environment) of the processes `parent` started."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        found.append((cmdline, env))
    return found


def test_pd_passes_the_transport_token_to_its_workers_by_environment_only(model_dir):
    token = "pd-shared-token-0123456789"

    def inspect(proc) -> None:
        workers = [(cmd, env) for cmd, env in worker_processes(proc.pid) if "llm serve" in cmd]
        assert len(workers) == 2
        for cmd, env in workers:
            assert token not in cmd and env.get("SAGE_KV_TRANSPORT__AUTH_TOKEN") == token

    # the KV still crosses (run_deployment checks both prompt blocks reached the decode worker)
    run_deployment(model_dir, "--kv-transport", f"backend=shm,auth-token={token}", inspect=inspect)


def test_pd_without_a_token_gives_its_workers_a_fresh_shared_one(model_dir):
    def inspect(proc) -> None:
        tokens = {env.get("SAGE_KV_TRANSPORT__AUTH_TOKEN") for cmd, env in worker_processes(proc.pid)
                  if "llm serve" in cmd}
        assert len(tokens) == 1 and None not in tokens and len(tokens.pop()) >= 32  # one, random, for both

    run_deployment(model_dir, inspect=inspect)  # and the KV crosses with it


def test_pd_with_the_ray_launcher_places_workers_as_actors(model_dir):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'sage-infer[ray]'): --launcher ray untested")
    run_deployment(model_dir, "--launcher", "ray")


def test_pd_spec_and_flag_mistakes_are_one_line_exit_2(sage):
    assert parse_pd("2p3d") == (2, 3)
    for spec in ("1P", "0P1D", "PD", "1D1P"):
        result = sage("llm", "serve", "--pd", spec)
        assert result.code == 2 and "--pd" in result.err and len(result.err.strip().splitlines()) == 1
    result = sage("llm", "serve", "--pd", "1P1D", "--role", "decode")
    assert result.code == 2 and "leave out --role" in result.err
    result = sage("llm", "serve", "--role", "middle")
    assert result.code == 2 and "role" in result.err


def test_launcher_flags_need_pd(sage):
    result = sage("llm", "serve", "--launcher", "ray")
    assert result.code == 2 and "give one" in result.err
    result = sage("llm", "serve", "--pd", "1P1D", "--launcher", "k8s")
    assert result.code == 2 and "expected local or ray" in result.err


def test_router_flag_mistakes_are_one_line_exit_2(sage):
    result = sage("llm", "router", "--prefill", "http://127.0.0.1:8100")
    assert result.code == 2 and "--decode" in result.err and len(result.err.strip().splitlines()) == 1
    result = sage("llm", "router", "--decode", "127.0.0.1:8200")
    assert result.code == 2 and "expected an http(s) URL" in result.err
    result = sage("llm", "router", "--decode", "http://127.0.0.1:8200", "--port", "70000")
    assert result.code == 2 and "--port" in result.err
