"""CLI flag > env SAGE_* > --config FILE > preset > default, proven field by field."""

from __future__ import annotations

import json

import pytest
import yaml

from sage_infer.config.overrides import CliLayer, add_kv_transport_flags, add_set_flags
from sage_infer.config.resolve import resolve_config
from sage_infer.config.transport import KVTransportConfig

LAYERS = ["default", "preset", "config", "env", "cli"]

# field, value per layer (None: that layer cannot set it), value as the model reports it
CASES = {
    "kv_transport.chunk_size": {"preset": None, "config": "2MiB", "env": "3MiB", "cli": "5MiB"},
    "kv_transport.max_inflight": {"preset": None, "config": 3, "env": "5", "cli": "7"},
    "kv_transport.timeout_s": {"preset": None, "config": 11.0, "env": "12", "cli": "13"},
    "kv_pool.block_size": {"config": 32, "env": "64", "cli": "128"},
    "scheduler.max_num_seqs": {"config": 3, "env": "4", "cli": "5"},
    "policy.eviction": {"config": "lfu", "env": "arc", "cli": "s3fifo"},
    "port": {"config": 9001, "env": "9002", "cli": "9003"},
}
EXPECTED = {
    "kv_transport.chunk_size": {"config": 2 << 20, "env": 3 << 20, "cli": 5 << 20},
    "kv_transport.max_inflight": {"config": 3, "env": 5, "cli": 7},
    "kv_transport.timeout_s": {"config": 11.0, "env": 12.0, "cli": 13.0},
    "kv_pool.block_size": {"config": 32, "env": 64, "cli": 128},
    "scheduler.max_num_seqs": {"config": 3, "env": 4, "cli": 5},
    "policy.eviction": {"config": "lfu", "env": "arc", "cli": "s3fifo"},
    "port": {"config": 9001, "env": 9002, "cli": 9003},
}
# the low-cost transport preset sets these (values from presets/transport/low-cost.yaml)
TRANSPORT_PRESET = "low-cost"


def _nested(dotted: str, value: object) -> dict:
    out: dict = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _value(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _resolve_with(tmp_path, dotted: str, top: str, use_preset: bool):
    """Set `dotted` in every layer up to `top` and resolve."""
    values = CASES[dotted]
    upto = LAYERS.index(top)
    config_file = None
    cli = CliLayer()
    env = {}
    if use_preset:
        cli.set("kv_transport.preset", TRANSPORT_PRESET, "--kv-transport preset")
    if upto >= LAYERS.index("config"):
        config_file = tmp_path / "serve.yaml"
        config_file.write_text(yaml.safe_dump(_nested(dotted, values["config"])))
    if upto >= LAYERS.index("env"):
        env["SAGE_" + dotted.replace(".", "__").upper()] = values["env"]
    if upto >= LAYERS.index("cli"):
        cli.set(dotted, values["cli"], "--set")
    return resolve_config(preset="cpu", config_file=config_file, cli=cli.values, cli_origins=cli.origins, env=env)


@pytest.mark.parametrize("dotted", list(CASES))
@pytest.mark.parametrize("top", ["config", "env", "cli"])
def test_highest_layer_wins_field_by_field(tmp_path, dotted, top):
    use_preset = dotted.startswith("kv_transport.")
    resolved = _resolve_with(tmp_path, dotted, top, use_preset)
    assert _value(resolved.config, dotted) == EXPECTED[dotted][top]
    assert resolved.sources[dotted] == top


@pytest.mark.parametrize("dotted", [d for d in CASES if d.startswith("kv_transport.")])
def test_transport_preset_beats_default(tmp_path, dotted):
    preset_values = yaml.safe_load(_transport_preset_text())["kv_transport"]
    field = dotted.split(".", 1)[1]
    if field not in preset_values:
        pytest.fail(f"transport preset {TRANSPORT_PRESET} must set {field} for this test to mean anything")
    resolved = _resolve_with(tmp_path, dotted, "preset", use_preset=True)
    assert resolved.sources[dotted] == "preset"
    assert resolved.origins[dotted].split(":")[0].endswith(f"{TRANSPORT_PRESET}.yaml")
    expected = _value(KVTransportConfig.model_validate({field: preset_values[field]}), field)
    assert _value(resolved.config, dotted) == expected


def _transport_preset_text() -> str:
    from sage_infer.config.presets import presets_dir

    return (presets_dir() / "transport" / f"{TRANSPORT_PRESET}.yaml").read_text()


@pytest.mark.parametrize("dotted", list(CASES))
def test_untouched_field_reports_default(dotted):
    resolved = resolve_config(preset="cpu", env={})
    assert dotted not in resolved.sources
    row = next(r for r in resolved.rows() if r["field"] == dotted)
    assert row["source"] == "default"


def test_hardware_preset_choice_follows_precedence(tmp_path):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("preset: ascend-910b\n")
    assert resolve_config(config_file=config_file, env={}).hardware_preset == "ascend-910b"
    env = {"SAGE_PRESET": "nvidia-h100"}
    assert resolve_config(config_file=config_file, env=env).hardware_preset == "nvidia-h100"
    assert resolve_config(preset="cpu", config_file=config_file, env=env).hardware_preset == "cpu"


def test_auto_preset_detects_cpu_here():
    resolved = resolve_config(env={})
    assert resolved.config.preset == "auto"
    assert resolved.hardware_preset == "cpu"
    assert resolved.config.hardware.name == "cpu"


def test_hardware_fields_come_from_preset_with_file_and_line():
    resolved = resolve_config(preset="nvidia-h100", env={})
    assert resolved.sources["hardware.memory.hbm_gb"] == "preset"
    assert resolved.origins["hardware.memory.hbm_gb"].split(":")[0].endswith("nvidia-h100.yaml")
    assert resolved.origins["hardware.memory.hbm_gb"].split(":")[1].isdigit()


def test_kv_transport_flags_parse_aliases_and_dashes():
    layer = CliLayer()
    add_kv_transport_flags(layer, ["preset=high-bw", "target-dtype=fp8_e4m3,inflight=3", "chunk_size=8MiB"])
    assert layer.values == {
        "kv_transport": {
            "preset": "high-bw",
            "target_dtype": "fp8_e4m3",
            "max_inflight": "3",
            "chunk_size": "8MiB",
        }
    }
    resolved = resolve_config(preset="cpu", cli=layer.values, cli_origins=layer.origins, env={})
    transport = resolved.config.kv_transport
    assert (transport.preset, transport.target_dtype, transport.max_inflight) == ("high-bw", "fp8_e4m3", 3)
    assert int(transport.chunk_size) == 8 << 20


def test_set_flag_reaches_nested_field():
    layer = CliLayer()
    add_set_flags(layer, ["kv_pool.memory_budget=2GiB", "tiers.remote_url=redis://127.0.0.1:6379/0"])
    config = resolve_config(preset="cpu", cli=layer.values, cli_origins=layer.origins, env={}).config
    assert int(config.kv_pool.memory_budget) == 2 << 30
    assert config.tiers.remote_url == "redis://127.0.0.1:6379/0"


def test_config_show_json_lists_sources(sage, tmp_path, monkeypatch):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("kv_pool:\n  block_size: 32\nscheduler:\n  max_num_seqs: 8\n")
    monkeypatch.setenv("SAGE_SCHEDULER__MAX_NUM_SEQS", "16")
    result = sage("config", "show", "--preset", "cpu", "--config", str(config_file),
                  "--kv-transport", "preset=high-bw", "--kv-transport", "backend=shm", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    rows = {r["field"]: r for r in data["fields"]}
    assert rows["kv_pool.block_size"]["source"] == "config"
    assert rows["kv_pool.block_size"]["origin"] == f"{config_file}:2"
    assert (rows["scheduler.max_num_seqs"]["value"], rows["scheduler.max_num_seqs"]["source"]) == (16, "env")
    assert rows["kv_transport.backend"]["source"] == "cli"
    assert rows["kv_transport.preset"]["value"] == "high-bw"
    assert rows["kv_transport.chunk_size"]["source"] == "preset"
    assert rows["host"] == {"field": "host", "value": "127.0.0.1", "source": "default", "origin": "",
                            "active": True, "inactive_reason": None}
    assert data["hardware_preset"] == "cpu"


def test_api_key_is_never_printed(sage, monkeypatch):
    monkeypatch.setenv("SAGE_API_KEY", "sk-very-secret")
    result = sage("config", "show", "--preset", "cpu", "--json")
    assert result.code == 0
    assert "sk-very-secret" not in result.out
    rows = {r["field"]: r for r in json.loads(result.out)["fields"]}
    assert rows["api_key"]["source"] == "env"


def test_explicit_env_dict_is_the_only_env_read(monkeypatch):
    """`resolve_config(env={...})` reads that dict, never the process env behind it."""
    monkeypatch.setenv("SAGE_PORT", "9001")
    monkeypatch.setenv("SAGE_KV_POOL__BLOCK_SIZE", "32")
    isolated = resolve_config(preset="cpu", env={})
    assert (isolated.config.port, isolated.config.kv_pool.block_size) == (8000, 16)
    assert "port" not in isolated.sources
    given = resolve_config(preset="cpu", env={"SAGE_PORT": "7000"})
    assert (given.config.port, given.config.kv_pool.block_size) == (7000, 16)
    assert (given.sources["port"], given.origins["port"]) == ("env", "env SAGE_PORT")
    process = resolve_config(preset="cpu")  # no env argument: os.environ
    assert (process.config.port, process.sources["port"]) == (9001, "env")
