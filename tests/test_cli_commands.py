"""The commands users meet first: each works and its --json form is valid JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sage_infer.config.presets import list_presets


def test_help_lists_command_groups(sage):
    result = sage("--help")
    assert result.code == 0
    for group in ("infer", "transport", "llm", "config"):
        assert group in result.out


def test_version(sage):
    from sage_infer import __version__

    result = sage("--version")
    assert result.code == 0 and __version__ in result.out


def test_backends_list_json_reports_each_backend_with_reason(sage):
    result = sage("infer", "backends:list", "--json")
    assert result.code == 0
    backends = {b["name"]: b for b in json.loads(result.out)["backends"]}
    assert set(backends) == {"native", "lmdeploy", "vllm"}
    for backend in backends.values():
        assert isinstance(backend["available"], bool)
        assert backend["available"] or backend["reason"]


def test_backends_list_says_missing_package(sage):
    result = sage("infer", "backends:list", "--json")
    vllm = next(b for b in json.loads(result.out)["backends"] if b["name"] == "vllm")
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert vllm["available"] is False and "vllm is not installed" in vllm["reason"]


def test_backends_list_table(sage):
    result = sage("infer", "backends:list")
    assert result.code == 0 and "native" in result.out and "lmdeploy" in result.out


def test_backends_list_table_prints_brackets_literally(sage):  # "[vllm]" in a reason is not rich markup
    reasons = [b["reason"] or "" for b in json.loads(sage("infer", "backends:list", "--json").out)["backends"]]
    bracketed = [word for reason in reasons for word in reason.split() if "[" in word]
    flat = " ".join(sage("infer", "backends:list").out.replace("│", " ").split())
    assert all(word in flat for word in bracketed)


def test_presets_list_json_has_every_shipped_preset(sage):
    result = sage("infer", "presets:list", "--json")
    assert result.code == 0
    data = json.loads(result.out)
    assert [h["name"] for h in data["hardware"]] == list_presets("hardware")
    assert {t["name"] for t in data["transport"]} == {"high-bw", "low-latency", "low-cost"}


def test_config_show_table_and_json_agree(sage):
    table = sage("config", "show", "--preset", "cpu")
    as_json = sage("config", "show", "--preset", "cpu", "--json")
    assert table.code == 0 and as_json.code == 0
    fields = [r["field"] for r in json.loads(as_json.out)["fields"] if not r["field"].startswith("hardware.")]
    for field in fields:
        assert field in table.out


def test_transport_probe_json(sage):
    result = sage("transport", "probe", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["cpu"]["logical_cores"] >= 1
    assert data["cpu"]["memcpy_gb_s"] > 0
    assert data["matched_preset"] in list_presets("hardware")
    assert {v["vendor"] for v in data["vendors"]} == {"nvidia", "hygon", "ascend", "cambricon", "kunlunxin"}
    for vendor in data["vendors"]:
        assert vendor["available"] or vendor["reason"]
    assert data["recommended_kv_transport"]["backend"] in ("shm", "tcp", "torchdist", "rdma")


def test_transport_probe_write_round_trips(sage, tmp_path):
    path = tmp_path / "this-host.yaml"
    result = sage("transport", "probe", "--write", str(path))
    assert result.code == 0, result.err
    written = yaml.safe_load(path.read_text())
    assert written["name"] == "this-host" and written["extends"]
    assert sage("infer", "presets:validate", str(path)).code == 0
    shown = json.loads(sage("config", "show", "--preset", str(path), "--json").out)
    rows = {r["field"]: r for r in shown["fields"]}
    assert rows["hardware.name"]["value"] == "this-host"
    if "bandwidth_gb_s" in written.get("memory", {}):
        assert rows["hardware.memory.bandwidth_gb_s"]["value"] == written["memory"]["bandwidth_gb_s"]


def test_transport_probe_write_rejects_non_yaml_name(sage, tmp_path):
    result = sage("transport", "probe", "--no-measure", "--write", str(tmp_path / "out.txt"))
    assert result.code == 2 and ".yaml" in result.err


@pytest.mark.skipif(shutil.which("sage") is None and not (Path(sys.executable).parent / "sage").exists(),
                    reason="console script not installed (run make install)")
@pytest.mark.parametrize("script", ["sage", "sage-infer"])
def test_console_scripts_print_valid_json(script):
    exe = shutil.which(script) or str(Path(sys.executable).parent / script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_")}
    commands = (["infer", "backends:list", "--json"], ["infer", "presets:list", "--json"],
                ["config", "show", "--json"], ["transport", "probe", "--json", "--no-measure"])
    for argv in commands if script == "sage" else commands[2:3]:  # the alias: the same entry point, once
        done = subprocess.run([exe, *argv], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        json.loads(done.stdout)


def test_import_pulls_no_optional_heavy_module():
    code = (
        "import sys, sage_infer, sage_infer.config, sage_infer.interfaces, sage_infer.cli.main;"
        "heavy = ('triton', 'torch_npu', 'torch_mlu', 'lmdeploy', 'vllm', 'ray', 'redis');"
        "bad = [m for m in heavy if m in sys.modules];"
        "print(','.join(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


VLLM_SERVE_FLAGS = [
    "--served-model-name", "chat", "--max-model-len", "256", "--dtype", "bfloat16",
    "--kv-cache-memory-bytes", "8MiB", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "128",
    "--block-size", "32"]


def test_vllm_serve_flags_set_the_same_fields_here_and_on_every_pd_worker(monkeypatch):
    """A vLLM serve command line works unchanged: each flag sets the field with the same meaning, in this process
    and (as --set) on the workers --pd starts."""
    from typer.testing import CliRunner

    import sage_infer.router.launch as router_launch
    import sage_infer.server.launch as server_launch
    from sage_infer.cli.main import app
    from sage_infer.config.overrides import CliLayer, add_set_flags

    seen: dict = {}
    monkeypatch.setattr(server_launch, "serve", lambda config: seen.setdefault("config", config) and 0)
    monkeypatch.setattr(router_launch, "serve_pd", lambda pd, args, *rest, **kw: seen.setdefault("args", args) and 0)
    result = CliRunner().invoke(app, ["llm", "serve", *VLLM_SERVE_FLAGS])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.model.served_name, config.model.max_model_len, config.model.dtype) == ("chat", 256, "bf16")
    assert (config.kv_pool.memory_budget, config.kv_pool.memory_utilization) == (8 << 20, 0.5)
    assert (config.kv_pool.enable_prefix_caching, config.kv_pool.block_size) == (False, 32)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (4, 512)
    assert config.scheduler.long_prefill_token_threshold == 128

    result = CliRunner().invoke(app, ["llm", "serve", "--pd", "1P1D", *VLLM_SERVE_FLAGS])
    assert result.exit_code == 0, result.output
    args = seen["args"]
    sets = [args[i + 1] for i, flag in enumerate(args) if flag == "--set"]
    layer = CliLayer()
    add_set_flags(layer, sets)
    assert layer.values["model"] == {"served_name": "chat", "max_model_len": "256", "dtype": "bfloat16"}
    assert layer.values["kv_pool"]["enable_prefix_caching"] == "False"
    assert layer.values["scheduler"]["long_prefill_token_threshold"] == "128"


def test_a_bad_vllm_style_flag_is_one_line_naming_it(sage):
    bad = sage("llm", "serve", "--dtype", "float64")
    assert bad.code == 2 and "--dtype" in bad.err and "model.dtype" in bad.err
