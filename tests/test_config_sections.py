"""Every ServeConfig section changes what gets built, or says it does not.

Each test resolves a config the way the CLI does (`resolve_config`), builds a real
engine (or server) on a tiny random model, and looks at what came out: pool dtype and
size, block size, scheduler config, eviction policy, device, bind address, API key.
`kv_transport` acts only with a prefill/decode `role`: otherwise it builds the very same
engine, and `config show` / `llm generate` say so. `tiers` builds the lower KV tiers.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sage_infer.config.resolve import resolve_config
from sage_infer.engine import build as build_module
from sage_infer.engine.build import build_engine
from sage_infer.errors import ConfigError
from sage_infer.hal.device import DeviceFacts
from tests.tiny_models import make_tiny_model

CPU_BF16 = DeviceFacts("cpu", True, "CPU has avx512_bf16")
CPU_NO_BF16 = DeviceFacts("cpu", False, "CPU has no AVX512-BF16/AMX-BF16 (bf16 would be emulated)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer fp32 llama checkpoint (fp32 in config.json)."""
    return make_tiny_model(tmp_path_factory.mktemp("sections") / "model", "llama")


@pytest.fixture(autouse=True)
def bf16_cpu(monkeypatch):
    """The CPU's bf16 support is a device fact; pin it so results do not depend on the host."""
    monkeypatch.setattr(build_module, "device_facts", lambda device: CPU_BF16)


def build(tiny, *sets: str, preset: str = "cpu", **kwargs):
    cli: dict = {"model": {"path": str(tiny)}}
    for item in sets:
        dotted, _, value = item.partition("=")
        node = cli
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return build_engine(resolve_config(preset=preset, cli=cli, env={}).config, **kwargs)


def pool_of(engine):
    return engine.runner.pool


def test_the_engine_carries_every_value_its_build_decided_as_printed(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="sage_infer.auto"):
        engine = build(tiny, "kv_pool.num_blocks=8")
    lines = [value.line() for value in engine.decisions]
    printed = [record.getMessage() for record in caplog.records if record.name == "sage_infer.auto"]
    assert lines == [line for line in printed if line in lines]  # each once, in the order it was printed
    fields = [value.field for value in engine.decisions]
    for field in ("device", "model.dtype", "kv_pool.num_blocks", "model.attention", "model.decode_step"):
        assert field in fields
    assert dict(zip(fields, (value.value for value in engine.decisions)))["kv_pool.num_blocks"] == 8


# --- model -------------------------------------------------------------------------


def test_model_section_sets_dtype_context_and_name(tiny):
    default = build(tiny, "kv_pool.num_blocks=8")
    changed = build(tiny, "kv_pool.num_blocks=8", "model.dtype=fp16", "model.max_model_len=64",
                    "model.served_name=tiny-chat", "model.revision=r2")
    assert next(default.runner.model.parameters()).dtype == torch.float32  # the checkpoint's dtype
    assert next(changed.runner.model.parameters()).dtype == torch.float16
    assert (default.max_model_len, changed.max_model_len) == (1024, 64)
    assert (default.model_id, changed.model_id) == ("model", "tiny-chat")
    assert changed.revision == "r2"


def test_model_max_len_above_the_checkpoint_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match=r"model.max_model_len: 4096 exceeds what the model supports \(1024\)"):
        build(tiny, "model.max_model_len=4096")


# --- kv_pool -----------------------------------------------------------------------


def test_kv_pool_section_sets_block_size_count_dtype_and_caching(tiny):
    default = build(tiny, "kv_pool.num_blocks=8")
    changed = build(tiny, "kv_pool.num_blocks=12", "kv_pool.block_size=32", "kv_pool.kv_dtype=fp16",
                    "kv_pool.enable_prefix_caching=false")
    assert (pool_of(default).num_blocks, pool_of(changed).num_blocks) == (8, 12)
    assert (pool_of(default).block_size, pool_of(changed).block_size) == (16, 32)
    assert pool_of(changed).dtype == torch.float16 and changed.kv_dtype == "fp16"
    assert default.kv.index is not None and changed.kv.index is None


def test_kv_pool_memory_budget_sizes_the_pool(tiny):
    engine = build(tiny, "kv_pool.memory_budget=1MiB")
    per_block = pool_of(engine).nbytes // pool_of(engine).num_blocks
    assert pool_of(engine).num_blocks == (1 << 20) // per_block


def test_kv_pool_auto_size_is_every_seat_at_full_context(tiny):
    engine = build(tiny, "scheduler.max_num_seqs=2", "model.max_model_len=64")
    assert pool_of(engine).num_blocks == 2 * (64 + 16) // 16


# --- policy ------------------------------------------------------------------------


@pytest.mark.parametrize("eviction", ["lru", "arc", "s3fifo"])
def test_policy_eviction_picks_the_index_policy(tiny, eviction):
    engine = build(tiny, "kv_pool.num_blocks=8", f"policy.eviction={eviction}")
    assert engine.kv.index.policy.name == eviction


# --- scheduler ---------------------------------------------------------------------


def test_scheduler_section_reaches_the_scheduler(tiny):
    engine = build(tiny, "kv_pool.num_blocks=8", "scheduler.strategy=priority", "scheduler.max_num_seqs=3",
                   "scheduler.max_num_batched_tokens=128", "scheduler.enable_chunked_prefill=false",
                   "scheduler.long_prefill_token_threshold=32")
    config = engine.scheduler.config
    assert (config.strategy, config.max_num_seqs, config.max_num_batched_tokens) == ("priority", 3, 128)
    assert config.enable_chunked_prefill is False and config.long_prefill_token_threshold == 32


# --- preset / hardware: device and kv_dtype auto -------------------------------------


def test_cpu_preset_puts_the_engine_on_cpu_with_its_default_kv_dtype(tiny):
    engine = build(tiny, "kv_pool.num_blocks=8")
    assert engine.device == torch.device("cpu")
    # fp32 checkpoint, cpu preset kv.default_dtype bf16, CPU with native bf16: the preset wins
    assert pool_of(engine).dtype == torch.bfloat16 and engine.kv_dtype == "bf16"


def test_kv_dtype_auto_falls_back_to_the_model_without_native_bf16(tiny, monkeypatch):
    monkeypatch.setattr(build_module, "device_facts", lambda device: CPU_NO_BF16)
    assert pool_of(build(tiny, "kv_pool.num_blocks=8")).dtype == torch.float32


def _own_preset(tmp_path, body: str) -> str:
    path = tmp_path / "mine.yaml"
    path.write_text("extends: cpu\nname: mine\n" + body)
    return str(path)


def test_preset_kv_default_drives_kv_dtype_auto(tiny, tmp_path):
    preset = _own_preset(tmp_path, "kv:\n  dtypes: [fp32, fp16]\n  default_dtype: fp16\n")
    assert pool_of(build(tiny, "kv_pool.num_blocks=8", preset=preset)).dtype == torch.float16


def test_a_quantized_preset_default_builds_a_quantized_pool(tiny, tmp_path):
    preset = _own_preset(tmp_path, "kv:\n  dtypes: [fp32, int8]\n  default_dtype: int8\n")
    engine = build(tiny, "kv_pool.num_blocks=8", preset=preset)
    assert pool_of(engine).schema.dtype.value == "int8" and engine.kv_dtype == "int8"


def test_explicit_kv_dtype_outside_the_preset_list_is_a_config_error(tiny, tmp_path):
    preset = _own_preset(tmp_path, "kv:\n  dtypes: [fp32, fp16]\n  default_dtype: fp16\n")
    with pytest.raises(ConfigError, match="kv_pool.kv_dtype: bf16 is not supported by preset mine"):
        build(tiny, "kv_pool.kv_dtype=bf16", preset=preset)


def test_accelerator_preset_without_its_device_is_one_line(tiny):
    with pytest.raises(ConfigError) as err:
        build(tiny, "kv_pool.num_blocks=8", preset="ascend-910b")
    assert str(err.value) == "preset ascend-910b needs torch_npu (Ascend NPU): not installed"


def test_explicit_device_wins_over_the_preset(tiny):
    engine = build(tiny, "kv_pool.num_blocks=8", preset="ascend-910b", device="cpu")
    assert engine.device == torch.device("cpu")
    assert engine.kv_dtype == "bf16"  # the ascend preset's kv.default_dtype still applies


# --- host / port / api_key: the server ------------------------------------------------


def test_host_port_api_key_and_max_waiting_reach_the_server(tiny, bf16_cpu):
    from fastapi.testclient import TestClient

    from sage_infer.server.launch import build_server

    cli = {"model": {"path": str(tiny)}, "kv_pool": {"num_blocks": 8}, "host": "0.0.0.0", "port": 8123,
           "api_key": "s3cret", "scheduler": {"max_waiting": 7}}
    server, async_engine, _ = build_server(resolve_config(preset="cpu", cli=cli, env={}).config)
    assert (server.config.host, server.config.port) == ("0.0.0.0", 8123)
    assert async_engine.max_waiting == 7
    client = TestClient(server.config.app)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


# --- tiers: the lower KV tiers are built -----------------------------------------------


def test_tiers_build_the_lower_kv_tiers(tiny, tmp_path):
    assert build(tiny, "kv_pool.num_blocks=8").kv.source("tiers") is None
    engine = build(tiny, "kv_pool.num_blocks=8", "tiers.host_bytes=1MiB", f"tiers.disk_path={tmp_path}",
                   "tiers.disk_bytes=64MiB")
    stores = engine.kv.source("tiers").hierarchy.stores
    assert [s.name for s in stores] == ["host", "disk"]
    assert stores[0].capacity_bytes == 1 << 20 and stores[1].capacity_bytes == 64 << 20
    assert engine.kv.block_manager.on_evict == engine.kv.source("tiers").hierarchy.on_evict


def test_a_disk_tier_without_a_size_is_one_config_error(tiny, tmp_path):
    with pytest.raises(ConfigError, match="tiers.disk_bytes"):
        build(tiny, "kv_pool.num_blocks=8", f"tiers.disk_path={tmp_path}")


def test_an_unreachable_remote_tier_fails_at_start(tiny):
    with pytest.raises(ConfigError, match="tiers: .*redis"):
        build(tiny, "kv_pool.num_blocks=8", "tiers.remote_url=redis://127.0.0.1:1/0")


# --- kv_transport: validated, shown inactive, warned -----------------------------------


def test_kv_transport_builds_the_same_engine(tiny):
    plain = build(tiny, "kv_pool.num_blocks=8")
    loaded = build(tiny, "kv_pool.num_blocks=8", "kv_transport.backend=tcp", "kv_transport.target_dtype=int4")
    assert (pool_of(loaded).num_blocks, pool_of(loaded).dtype) == (pool_of(plain).num_blocks, pool_of(plain).dtype)
    assert loaded.scheduler.config == plain.scheduler.config and loaded.device == plain.device


def test_config_show_marks_kv_transport_inactive_and_tiers_active(sage):
    data = json.loads(sage("config", "show", "--preset", "cpu", "--json", "--kv-transport", "backend=tcp").out)
    rows = {r["field"]: r for r in data["fields"]}
    assert rows["tiers.host_bytes"]["active"] is True
    assert rows["kv_transport.backend"]["active"] is False and "--role" in rows["kv_transport.backend"][
        "inactive_reason"]
    assert rows["kv_pool.block_size"]["active"] is True and rows["kv_pool.block_size"]["inactive_reason"] is None
    table = sage("config", "show", "--preset", "cpu").out
    assert "INACTIVE kv_transport:" in table and "INACTIVE tiers" not in table


def test_a_prefill_or_decode_role_makes_kv_transport_active(sage):
    data = json.loads(sage("config", "show", "--preset", "cpu", "--json", "--set", "role=decode").out)
    rows = {r["field"]: r for r in data["fields"]}
    assert rows["kv_transport.backend"]["active"] is True and rows["kv_transport.timeout_s"]["active"] is True
    assert rows["kv_transport.preset"]["active"] is False  # informational: where the values started from


def test_roles_build_a_kv_connector_from_kv_transport(tiny):
    prefill = build(tiny, "kv_pool.num_blocks=8", "role=prefill", "kv_transport.backend=tcp")
    decode = build(tiny, "kv_pool.num_blocks=8", "role=decode", "kv_transport.timeout_s=7")
    try:
        info = prefill.pd.info()
        assert (info.role, info.address) == ("prefill", None)
        assert prefill.kv.source("transfers").transfers.pipe.backend == "tcp"
        info = decode.pd.info()
        assert info.role == "decode" and info.address.startswith("shm://")  # auto: one host, shared memory
        assert decode.kv.source("transfers").transfers.pipe.config.timeout_s == 7
        assert info.schema_digest == prefill.kv_schema_digest
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert build(tiny, "kv_pool.num_blocks=8").pd is None


def test_a_role_with_a_transport_it_cannot_use_is_one_config_error(tiny):
    decode = build(tiny, "kv_pool.num_blocks=8", "role=decode", "kv_transport.target_dtype=int8")
    try:  # a wire dtype is allowed: the pipe receives blocks in it (tests/test_pd_low_cost.py)
        assert decode.kv.source("transfers").transfers.pipe.schema.dtype.value == "int8"
    finally:
        decode.shutdown()
    with pytest.raises(ConfigError, match="kv_transport.backend: rdma"):
        build(tiny, "kv_pool.num_blocks=8", "role=prefill", "kv_transport.backend=rdma")


def test_llm_generate_warns_once_about_explicit_inactive_fields(sage, tiny):
    result = sage("llm", "generate", "--model", str(tiny), "--prompt", "hi", "--max-tokens", "2", "--temperature",
                  "0", "--preset", "cpu", "--set", "kv_pool.num_blocks=8",
                  "--kv-transport", "preset=high-bw,backend=tcp,target-dtype=int4")
    assert result.code == 0, result.err
    warnings = [line for line in result.err.splitlines() if line.startswith("sage: warning:")]
    assert len(warnings) == 1
    assert "kv_transport.target_dtype" in warnings[0] and "tiers" not in warnings[0]
    assert "kv_transport.chunk_size" not in warnings[0]  # from the transport preset, not set by the user
    resolved = [line for line in result.err.splitlines() if line.startswith("sage: resolved ")]
    assert [line.split()[2].rstrip(":") for line in resolved] == ["model.linear", "model.decode_linear",
                                                                  "model.huge_pages",
                                                      "model.host_malloc", "cpu_kernels", "model.elementwise",
                                                      "device", "model.dtype", "kv_pool.kv_dtype",
                                                      "model.max_model_len", "kv_pool.num_blocks", "tiers.host_bytes",
                                                      "kv_pool.layer_loads", "model.attention",
                                                      "model.prefill_attention", "model.decode_step",
                                                      "model.cuda_graphs"]
    assert "sage: resolved model.cuda_graphs = off (auto: CUDA graphs need an NVIDIA CUDA device" in result.err
    assert "sage: resolved device = cpu (hardware preset cpu" in result.err
    assert "sage: resolved tiers.host_bytes = 0 (auto: the KV pool is in host memory already" in result.err


def test_the_long_prefill_cap_is_active_only_with_chunked_prefill(sage):
    def row(*sets):
        args = [arg for s in sets for arg in ("--set", s)]
        data = json.loads(sage("config", "show", "--preset", "cpu", "--json", *args).out)
        return {r["field"]: r for r in data["fields"]}["scheduler.long_prefill_token_threshold"]
    assert row("scheduler.long_prefill_token_threshold=64")["active"] is True
    off = row("scheduler.long_prefill_token_threshold=64", "scheduler.enable_chunked_prefill=false")
    assert off["active"] is False and "enable_chunked_prefill" in off["inactive_reason"]


def test_short_prefill_first_is_active_only_with_a_threshold_and_chunked_prefill(sage):
    def row(*sets):
        args = [arg for s in sets for arg in ("--set", s)]
        data = json.loads(sage("config", "show", "--preset", "cpu", "--json", *args).out)
        return {r["field"]: r for r in data["fields"]}["scheduler.short_prefill_first"]
    assert row("scheduler.short_prefill_first=true", "scheduler.long_prefill_token_threshold=64")["active"] is True
    alone = row("scheduler.short_prefill_first=true")
    assert alone["active"] is False and "long_prefill_token_threshold" in alone["inactive_reason"]
    unchunked = row("scheduler.short_prefill_first=true", "scheduler.long_prefill_token_threshold=64",
                    "scheduler.enable_chunked_prefill=false")
    assert unchunked["active"] is False


def test_llm_generate_without_inactive_fields_warns_nothing(sage, tiny):
    result = sage("llm", "generate", "--model", str(tiny), "--prompt", "hi", "--max-tokens", "2", "--preset", "cpu",
                  "--set", "kv_pool.num_blocks=8")
    assert result.code == 0, result.err
    assert "warning" not in result.err


def test_the_router_section_is_active_only_with_pd(sage):
    plain = {r["field"]: r for r in json.loads(sage("config", "show", "--preset", "cpu", "--json").out)["fields"]}
    assert plain["router.strategy"]["active"] is False and "--pd" in plain["router.strategy"]["inactive_reason"]
    data = json.loads(sage("config", "show", "--preset", "cpu", "--json", "--set", "pd=1P1D",
                           "--set", "router.strategy=slo").out)
    rows = {r["field"]: r for r in data["fields"]}
    assert rows["router.strategy"]["active"] is True and rows["router.strategy"]["value"] == "slo"
    assert rows["kv_transport.backend"]["active"] is True  # the workers a --pd deployment starts use it
    bad = sage("config", "show", "--preset", "cpu", "--set", "router.strategy=random")
    assert bad.code == 2 and "router.strategy" in bad.err
