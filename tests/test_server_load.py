"""200 concurrent streaming requests, some cancelled mid-stream: every one finishes or is
cancelled as asked, no block leaks, and /metrics agrees with what the clients saw."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import running_server
from tests.tiny_models import make_tiny_model

NUM_REQUESTS = 200
CANCEL_EVERY = 5  # every 5th request is cancelled after its first chunks


def _counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("load") / "tiny-qwen3", "qwen3")


def test_200_concurrent_streams_with_cancellations(model_dir):
    rng = random.Random(0)
    with running_server(model_dir, num_blocks=256, max_num_seqs=48) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256)))
        # cancelled requests ask for far more tokens than they can produce before the cancel lands
        jobs = [([rng.randrange(10, 500) for _ in range(rng.randint(4, 120))],
                 800 if i % CANCEL_EVERY == 0 else rng.randint(4, 24)) for i in range(NUM_REQUESTS)]

        async def one(i: int, prompt: list[int], max_tokens: int) -> dict:
            stream = await client.completions.create(
                model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            received, usage, reason = "", None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices:
                    received += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                    if i % CANCEL_EVERY == 0 and received:
                        await stream.close()
                        return {"cancelled": True, "prompt": len(prompt)}
            return {"cancelled": False, "prompt": len(prompt), "usage": usage, "reason": reason,
                    "max_tokens": max_tokens}

        async def main():
            return await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(jobs)))

        results = asyncio.run(main())
        finished = [r for r in results if not r["cancelled"]]
        cancelled = [r for r in results if r["cancelled"]]
        assert len(cancelled) == NUM_REQUESTS // CANCEL_EVERY
        assert all(r["reason"] == "length" and r["usage"].completion_tokens == r["max_tokens"] for r in finished)

        deadline = time.monotonic() + 30
        manager = server.backend.engine.kv.block_manager
        while (server.backend.num_in_flight or manager.get_utilization()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.get_utilization() == 0.0, "blocks leaked after the load test"
        manager.check_invariants()

        counters = _counters(server.url)
        assert counters["sage:request_success_total[length]"] == len(finished)
        assert counters["sage:request_success_total[abort]"] == len(cancelled)
        assert counters["sage:prompt_tokens_total"] == sum(r["prompt"] for r in results)
        finished_tokens = sum(r["usage"].completion_tokens for r in finished)
        assert counters["sage:generation_tokens_total"] >= finished_tokens + len(cancelled)
        assert counters["sage:time_to_first_token_seconds_count"] == NUM_REQUESTS
        assert counters["sage:num_requests_running"] == 0 and counters["sage:num_requests_waiting"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir, port: int, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sage_infer.cli.main import main; sys.exit(main(sys.argv[1:]))",
         "llm", "serve", "--model", str(model_dir), "--port", str(port), "--set", "model.dtype=fp32", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    banner = proc.stdout.readline()
    assert f"http://127.0.0.1:{port}/v1" in banner, banner + proc.stderr.read()
    return proc


def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir):
    port = _free_port()
    proc = _serve(model_dir, port, "--set", "kv_pool.num_blocks=64")
    try:
        assert "curl" in proc.stdout.readline() + proc.stdout.readline()
        body = {"model": "tiny-qwen3", "prompt": list(range(10, 50)), "max_tokens": 60, "stream": True,
                "ignore_eos": True, "temperature": 0}
        tokens = 0
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += 1
                    if tokens == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still complete
                if line == "data: [DONE]":
                    break
        assert tokens >= 60
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()




RESTART_PROMPTS = [[10 + (7 * p + 3 * j) % 400 for j in range(120)] for p in range(10)]  # 7 full blocks each


def _ask(port: int, prompt: list[int]) -> dict:
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _restart_answers_the_same(model_dir, disk, answer: dict, cached: int) -> None:
    """A restart on `disk` with the disk tier alone: the first prompt again finds `cached` of its tokens and
    answers `answer`'s text; then a clean SIGTERM."""
    port = _free_port()
    server = _serve(model_dir, port, "--set", "kv_pool.num_blocks=24", "--set", "kv_pool.block_size=16",
                    "--kv-tiers", f"disk={disk}:256MiB")
    try:
        again = _ask(port, RESTART_PROMPTS[0])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.parametrize("flush_s", [30, 0])
def test_after_sigterm_a_restart_on_the_same_disk_tier_hits_what_the_host_tier_and_device_held(model_dir, tmp_path,
                                                                                               flush_s):
    """Host + disk tiers and a device pool of 24 blocks: ten prompts, SIGTERM, a restart with the disk tier alone:
    the first prompt again finds its whole prefix (its blocks were in the host tier at the end, which the graceful
    exit copied to disk), and answers the same text. With `tiers.flush_on_shutdown_s=0` nothing is copied."""
    disk = tmp_path / "kv"
    prompts = RESTART_PROMPTS

    port = _free_port()
    first = _serve(model_dir, port, "--set", "kv_pool.num_blocks=24", "--set", "kv_pool.block_size=16",
                   "--kv-tiers", f"host=256MiB,disk={disk}:256MiB", "--set", f"tiers.flush_on_shutdown_s={flush_s}")
    try:
        answers = [_ask(port, prompt) for prompt in prompts]
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        assert ("kept" in first.stderr.read()) == bool(flush_s)
    finally:
        if first.poll() is None:
            first.kill()
    _restart_answers_the_same(model_dir, disk, answers[0], 112 if flush_s else 0)  # 7 blocks


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_after_sigkill_a_restart_serves_the_same_text_and_write_through_kept_the_prefix(model_dir, tmp_path, policy):
    """Host + disk tiers, ten prompts, then SIGKILL as the last prompt's blocks are still being written: no graceful
    copy happens. The restart on the same disk directory starts (a torn last record is skipped by its CRC) and
    answers the first prompt with the same text; under write_through the disk already had its prefix, under
    write_back (everything still fitted in the host tier) it has nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    disk = tmp_path / "kv"
    prompts = RESTART_PROMPTS

    def disk_blocks(port: int, name: str = "sage:kv_tier_blocks", direction: str | None = None) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and s.labels.get("tier") == "disk" and s.labels.get("direction") == direction)

    flags = ("--set", "kv_pool.num_blocks=24", "--set", "kv_pool.block_size=16")
    port = _free_port()
    first = _serve(model_dir, port, *flags, "--kv-tiers", f"host=256MiB,disk={disk}:256MiB",
                   "--set", f"tiers.write_policy={policy}")
    try:
        answers = [_ask(port, prompt) for prompt in prompts[:-1]]
        if policy == "write_through":  # the first prompt's 7 blocks are on disk (the writer works in the background)
            deadline = time.monotonic() + 30
            while disk_blocks(port) < 7 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert disk_blocks(port, "sage:kv_tier_migrated_blocks_total", "write_through") >= 7 * 9
        _ask(port, prompts[-1])
        first.kill()  # its blocks may be mid-write
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    _restart_answers_the_same(model_dir, disk, answers[0], 112 if policy == "write_through" else 0)
