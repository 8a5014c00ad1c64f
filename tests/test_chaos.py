"""Chaos: real faults under a serving process, and what the client and the operator see.

The disk tier's files hit a real kernel limit (`RLIMIT_FSIZE` on the server process: every write past it fails
with EFBIG, as a full filesystem fails with ENOSPC) while prompts are served, re-asked and demoted again. The
server runs `--deterministic`, so a prompt's answer does not depend on whether its prefix came back from the
disk, was recomputed after a failed write, or was computed in other chunks: every answer must equal the first.
The fault must be visible: `sage:kv_tier_errors_total{tier="disk"}` counts it and `/health` says degraded
with the reason, while every request still succeeds; the blocks stored before the limit are loaded again once
the tier's rest after a failure is over.

The same holds for a Redis tier whose server is killed mid-run and started again on its port: answers unchanged,
the failure counted and shown by `/health`, and once the tier's rest is over blocks are written to and loaded from
the new Redis. And for SIGTERM while streams run: every stream either finishes with the text a restarted server
gives for its prompt or ends with an error event and `[DONE]` (never a cut connection), and the restarted server's
greedy answers (text and logprobs) equal those before the restart.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.hal.net import free_port
from sage_infer.kv_runtime.hierarchy import RETRY_AFTER_S
from sage_infer.layers.cpu_kernels import kernel_unavailable
from tests.redis_fixture import start_redis
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"--deterministic needs the paged decode kernel: {kernel_unavailable()}")

FILE_LIMIT = 256 << 10  # bytes a file of the server may grow by: the disk tier fills them within the first prompts
PROMPTS = [[10 + (11 * p + 5 * j) % 450 for j in range(330)] for p in range(8)]  # 20 full blocks each
# a 32-block pool (each prompt demotes the last into the tier), --deterministic, and a device this slow that every
# evicted block is worth keeping (the cost model drops a tiny model's)
TIERED = ("--set", "kv_pool.num_blocks=32", "--set", "kv_pool.block_size=16", "--deterministic",
          "--set", "hardware.device.dense_bf16_tflops=0.0001")
SERVE = "import sys; from sage_infer.cli.main import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chaos") / "tiny-qwen3", "qwen3")


def _ignore_file_size_signal() -> None:
    """In the server process: a write past its file size limit fails with EFBIG instead of killing it (SIGXFSZ)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _limit_files(server: subprocess.Popen, directory) -> None:
    """From now on the server's files may grow FILE_LIMIT bytes past the disk tier's largest segment (what its
    start-up read probe wrote is already there)."""
    written = max((path.stat().st_size for path in directory.glob("*.seg")), default=0)
    resource.prlimit(server.pid, resource.RLIMIT_FSIZE, (written + FILE_LIMIT, written + FILE_LIMIT))


def _serve(model_dir, port: int, *flags: str, drain_s: int | None = None, preexec_fn=None) -> subprocess.Popen:
    """`sage llm serve` on `port` in its own process, once it listens (its drain `drain_s` when given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_")}
    drain = () if drain_s is None else ("--set", f"drain_timeout_s={drain_s}")
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE, "llm", "serve", "--model", str(model_dir), "--port", str(port),
         "--set", "model.dtype=fp32", *drain, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=preexec_fn)
    banner = server.stdout.readline()
    assert f"http://127.0.0.1:{port}/v1" in banner, banner + server.stderr.read()
    return server


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM: a clean exit."""
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0


def _ask(port: int, prompt: list[int], max_tokens: int = 8) -> dict:
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _tier(port: int, name: str = "sage:kv_tier_errors_total", tier: str = "disk", direction: str | None = None
          ) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("tier") == tier and s.labels.get("direction") == direction)


def _health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()


def _same(answer: dict, first: dict) -> None:
    assert answer["choices"][0]["text"] == first["choices"][0]["text"]
    assert answer["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_a_disk_tier_that_hits_a_file_size_limit_is_visible_and_costs_no_token(model_dir, tmp_path):
    port = free_port()
    server = _serve(model_dir, port, *TIERED, "--kv-tiers", f"disk={tmp_path / 'kv'}:64MiB",
                    preexec_fn=_ignore_file_size_signal)
    try:
        _limit_files(server, tmp_path / "kv")
        first = [_ask(port, prompt) for prompt in PROMPTS]  # a 32-block pool: each prompt demotes the last
        deadline = time.monotonic() + 30
        while _tier(port) == 0:  # the writer thread fails in the background; the next step counts it
            assert time.monotonic() < deadline, "the disk tier's failed writes were never counted"
            _ask(port, PROMPTS[0])
        time.sleep(RETRY_AFTER_S + 0.2)  # the failing tier rests this long; then its stored blocks are read again
        again = _ask(port, PROMPTS[0])  # its first blocks were the first demoted: stored before the file was full
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0] == first[0]["choices"][0]
        assert _tier(port, "sage:kv_tier_migrated_blocks_total", direction="load") > 0
        for _ in range(2):  # again, in another order: loads, failed loads and recomputes all give the same answer
            for i in reversed(range(len(PROMPTS))):
                _same(_ask(port, PROMPTS[i]), first[i])
        health = _health(port)
        assert health["status"] == "degraded" and "disk" in health["degraded"], health
        assert "failed" in health["degraded"]["disk"] and str(tmp_path / "kv") in health["degraded"]["disk"], health
        _stop(server)
    finally:
        if server.poll() is None:
            server.kill()


def test_a_redis_tier_killed_and_restarted_mid_run_is_visible_and_costs_no_token(model_dir):
    redis = start_redis()
    port = free_port()
    server = None
    try:
        server = _serve(model_dir, port, *TIERED, "--kv-tiers", f"remote={redis.url}")
        first = [_ask(port, prompt) for prompt in PROMPTS]
        assert redis.client().dbsize() > 0 and _tier(port, "sage:kv_tier_up", "redis") == 1
        again = _ask(port, PROMPTS[0])  # its blocks were the first demoted
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        _same(again, first[0])

        redis.kill()
        for i in reversed(range(len(PROMPTS))):  # loads and demotions fail: recomputed, the same answers
            _same(_ask(port, PROMPTS[i]), first[i])
        errors = _tier(port, tier="redis")
        assert errors >= 1 and _tier(port, "sage:kv_tier_up", "redis") == 0
        health = _health(port)
        assert health["status"] == "degraded" and "redis" in health["degraded"], health

        redis = start_redis(redis.port)  # empty: what the old one held is gone
        time.sleep(RETRY_AFTER_S + 0.2)  # the failed tier's rest
        stored = _tier(port, "sage:kv_tier_migrated_blocks_total", "redis", "demote")
        loaded = _tier(port, "sage:kv_tier_migrated_blocks_total", "redis", "load")
        for i in reversed(range(len(PROMPTS))):  # misses for the blocks the old Redis had; demotions into the new
            _same(_ask(port, PROMPTS[i]), first[i])
        assert redis.client().dbsize() > 0
        assert _tier(port, "sage:kv_tier_migrated_blocks_total", "redis", "demote") > stored
        again = _ask(port, PROMPTS[-1])  # demoted into the new Redis by the prompts after it
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        _same(again, first[-1])
        assert _tier(port, "sage:kv_tier_migrated_blocks_total", "redis", "load") > loaded
        assert _tier(port, tier="redis") == errors and _tier(port, "sage:kv_tier_up", "redis") == 1
        assert _health(port) == {"status": "ok"}
        _stop(server)
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        redis.kill()


def _stream(port: int, prompt: list[int], max_tokens: int, lines: list[str]) -> None:
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as reply:
        lines.extend(line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))


def test_sigterm_mid_stream_finishes_each_stream_or_ends_it_with_an_error_and_a_restart_answers_the_same(model_dir):
    """Two short and two long streams run when SIGTERM comes, with a 1 s drain: a stream that finishes has the
    text a restarted server gives its prompt; one the drain cuts ends with a 503 error event and `[DONE]`, its
    text a prefix of that. The long ones (600 tokens) cannot finish in time, so the cut is seen every run."""
    streams = [([20 + (13 * p + 7 * j) % 400 for j in range(40)], 32 if p < 2 else 600) for p in range(4)]
    port = free_port()
    server = _serve(model_dir, port, "--set", "kv_pool.num_blocks=256", "--deterministic", drain_s=1)
    readers: list[threading.Thread] = []
    try:
        before = [_ask(port, prompt, max_tokens) for prompt, max_tokens in streams[:2]]
        lines: list[list[str]] = [[] for _ in streams]
        readers = [threading.Thread(target=_stream, args=(port, prompt, max_tokens, out))
                   for (prompt, max_tokens), out in zip(streams, lines)]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 30
        while min(len(out) for out in lines) < 2:
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.005)
        server.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
        for reader in readers:
            reader.join(60)

    port = free_port()
    server = _serve(model_dir, port, "--set", "kv_pool.num_blocks=256", "--deterministic")
    try:
        with ThreadPoolExecutor(len(streams)) as pool:  # batched together: --deterministic answers the same
            after = list(pool.map(lambda stream: _ask(port, *stream), streams))
        for answer, first in zip(after, before):
            _same(answer, first)
        cut = 0
        for out, answer in zip(lines, after):
            assert out[-1] == "[DONE]", out[-3:]
            events = [json.loads(event) for event in out[:-1]]
            text = "".join(event["choices"][0]["text"] for event in events if "choices" in event)
            if "error" in events[-1]:
                assert events[-1]["error"]["code"] == 503 and "drain" in events[-1]["error"]["message"]
                assert answer["choices"][0]["text"].startswith(text) and text != answer["choices"][0]["text"]
                cut += 1
            else:
                assert text == answer["choices"][0]["text"]
        assert cut >= 2  # the long streams
        _stop(server)
    finally:
        if server.poll() is None:
            server.kill()
