"""Chaos: real faults under a serving process, and what the client and the operator see.

The disk tier's files hit a real kernel limit (`RLIMIT_FSIZE` on the server process: every write past it fails
with EFBIG, as a full filesystem fails with ENOSPC) while prompts are served, re-asked and demoted again. The
server runs `--deterministic`, so a prompt's answer does not depend on whether its prefix came back from the
disk, was recomputed after a failed write, or was computed in other chunks: every answer must equal the first.
The fault must be visible: `sage:kv_tier_errors_total{tier="disk"}` counts it and `/health` says degraded
with the reason, while every request still succeeds; the blocks stored before the limit are loaded again once
the tier's rest after a failure is over.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.kv_runtime.hierarchy import RETRY_AFTER_S
from sage_infer.layers.cpu_kernels import kernel_unavailable
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason=f"--deterministic needs the paged decode kernel: {kernel_unavailable()}")

FILE_LIMIT = 256 << 10  # bytes a file of the server may reach: the disk tier fills it within the first prompts
PROMPTS = [[10 + (11 * p + 5 * j) % 450 for j in range(330)] for p in range(8)]  # 20 full blocks each


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chaos") / "tiny-qwen3", "qwen3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit_files() -> None:
    """In the server process: writes past FILE_LIMIT fail with EFBIG instead of killing it with SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def _ask(port: int, prompt: list[int]) -> dict:
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _disk(port: int, name: str = "sage:kv_tier_errors_total", direction: str | None = None) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("tier") == "disk" and s.labels.get("direction") == direction)


def test_a_disk_tier_that_hits_a_file_size_limit_is_visible_and_costs_no_token(model_dir, tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_")}
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sage_infer.cli.main import main; sys.exit(main(sys.argv[1:]))",
         "llm", "serve", "--model", str(model_dir), "--port", str(port), "--set", "model.dtype=fp32",
         "--set", "kv_pool.num_blocks=32", "--set", "kv_pool.block_size=16", "--deterministic",
         # a device this slow makes every evicted block worth keeping (the cost model drops a tiny model's)
         "--set", "hardware.device.dense_bf16_tflops=0.0001", "--kv-tiers", f"disk={tmp_path / 'kv'}:64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_limit_files)
    try:
        banner = server.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in banner, banner + server.stderr.read()
        first = [_ask(port, prompt) for prompt in PROMPTS]  # a 32-block pool: each prompt demotes the last
        deadline = time.monotonic() + 30
        while _disk(port) == 0:  # the writer thread fails in the background; the next step counts it
            assert time.monotonic() < deadline, "the disk tier's failed writes were never counted"
            _ask(port, PROMPTS[0])
        time.sleep(RETRY_AFTER_S + 0.2)  # the failing tier rests this long; then its stored blocks are read again
        again = _ask(port, PROMPTS[0])  # its first blocks were the first demoted: stored before the file was full
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0] == first[0]["choices"][0]
        assert _disk(port, "sage:kv_tier_migrated_blocks_total", "load") > 0
        for _ in range(2):  # again, in another order: loads, failed loads and recomputes all give the same answer
            for i in reversed(range(len(PROMPTS))):
                again = _ask(port, PROMPTS[i])
                assert again["choices"][0]["text"] == first[i]["choices"][0]["text"]
                assert again["choices"][0]["logprobs"] == first[i]["choices"][0]["logprobs"]
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["status"] == "degraded" and "disk" in health["degraded"], health
        assert "failed" in health["degraded"]["disk"] and str(tmp_path / "kv") in health["degraded"]["disk"], health
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
