"""Operators write their own preset on top of a shipped one with `extends:`."""

from __future__ import annotations

import json

from sage_infer.config.hardware import Confidence
from sage_infer.config.presets import load_hardware_preset
from sage_infer.config.resolve import resolve_config


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_override_keeps_everything_else_from_the_base(tmp_path):
    path = _write(tmp_path, "my-910b.yaml", "extends: ascend-910b\nname: my-910b\nmemory:\n  hbm_gb: 32\n")
    mine = load_hardware_preset(str(path)).profile
    base = load_hardware_preset("ascend-910b").profile
    assert mine.name == "my-910b"
    assert mine.memory.hbm_gb == 32
    assert mine.memory.bandwidth_gb_s == base.memory.bandwidth_gb_s
    assert mine.intra_node_link == base.intra_node_link
    assert mine.device.torch_device_type == "npu"


def test_override_without_source_is_marked_placeholder(tmp_path):
    path = _write(tmp_path, "mine.yaml", "extends: nvidia-h100\nname: mine\nmemory:\n  hbm_gb: 94\n")
    mine = load_hardware_preset(str(path)).profile
    assert mine.confidence_of("memory.hbm_gb") is Confidence.PLACEHOLDER
    assert mine.confidence_of("memory.bandwidth_gb_s") is Confidence.OFFICIAL


def test_override_with_source_keeps_it(tmp_path):
    path = _write(
        tmp_path,
        "mine.yaml",
        "extends: nvidia-h100\nname: mine\nmemory:\n  hbm_gb: 94\n"
        "sources:\n  memory.hbm_gb:\n    confidence: measured\n    ref: nvidia-smi on node-7\n",
    )
    assert load_hardware_preset(str(path)).profile.confidence_of("memory.hbm_gb") is Confidence.MEASURED


def test_replaced_list_drops_sources_of_missing_items(tmp_path):
    path = _write(tmp_path, "mine.yaml", "extends: nvidia-h100\nname: mine\ninter_node_nics: []\n")
    mine = load_hardware_preset(str(path)).profile
    assert mine.inter_node_nics == []
    assert not any(key.startswith("inter_node_nics.") for key in mine.sources)


def test_chain_of_extends_merges_in_order(tmp_path):
    _write(tmp_path, "mid.yaml", "extends: cpu\nname: mid\nmemory:\n  hbm_gb: 256\n  bandwidth_gb_s: 100\n")
    top = _write(tmp_path, "top.yaml", "extends: mid.yaml\nname: top\nmemory:\n  bandwidth_gb_s: 80\n")
    loaded = load_hardware_preset(str(top))
    assert (loaded.profile.memory.hbm_gb, loaded.profile.memory.bandwidth_gb_s) == (256, 80)
    assert [p.rsplit("/", 1)[-1] for p in loaded.source.chain] == ["top.yaml", "mid.yaml", "cpu.yaml"]
    assert loaded.source.where("memory.hbm_gb") == f"{tmp_path / 'mid.yaml'}:4"


def test_own_preset_drives_the_serve_config(tmp_path):
    path = _write(tmp_path, "mine.yaml", "extends: ascend-910b\nname: mine\n")
    resolved = resolve_config(preset=str(path), env={})
    assert resolved.config.hardware.name == "mine"
    assert resolved.config.preset_kv_dtype().value == "bf16"


def test_presets_show_lists_confidence_per_number(sage):
    result = sage("infer", "presets:show", "nvidia-h100", "--json")
    assert result.code == 0
    data = json.loads(result.out)
    numbers = {n["field"]: n for n in data["numbers"]}
    assert numbers["memory.hbm_gb"]["value"] == 80
    assert numbers["memory.hbm_gb"]["confidence"] == "official"
    assert all(n["confidence"] != "unspecified" for n in data["numbers"])


def test_presets_show_transport(sage):
    result = sage("infer", "presets:show", "high-bw", "--json")
    assert result.code == 0
    data = json.loads(result.out)
    assert data["kind"] == "transport" and data["kv_transport"]["max_inflight"] == 32


def test_presets_validate_ok(sage, tmp_path):
    path = _write(tmp_path, "mine.yaml", "extends: ascend-910b\nname: mine\n")
    result = sage("infer", "presets:validate", str(path), "--json")
    assert result.code == 0
    assert json.loads(result.out)["valid"] is True
