"""`sage compress quantize MODEL OUT`: writes a quantized HF directory that `sage llm generate`
runs; every bad flag or input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from sage_infer.models.loader import DEMO_MODEL_DIR


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line, got: {err!r}"
    return lines[0]


def test_quantize_writes_a_model_that_generates(sage, tmp_path):
    out = tmp_path / "demo-w4"
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(out), "--scheme", "w4a16", "--group-size", "32",
                "--json")
    assert done.code == 0, done.err
    report = json.loads(done.out)
    assert report["scheme"] == "w4a16-g32" and report["method"] == "rtn"
    assert report["quantized_layers"] == 4 * 7  # 4 layers x q, k, v, o, gate, up, down
    assert report["bytes_after"] < report["bytes_before"] * 0.5
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["num_bits"] == 4 and weights["weights"]["group_size"] == 32
    gen = sage("llm", "generate", "--model", str(out), "--prompt", "ROMEO:", "--max-tokens", "8",
               "--temperature", "0", "--json")
    assert gen.code == 0, gen.err
    assert len(json.loads(gen.out.splitlines()[-1])["token_ids"]) == 8


def test_w8a16_defaults_to_one_scale_per_output_channel(sage, tmp_path):
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "w8"), "--scheme", "w8a16", "--json")
    assert done.code == 0, done.err
    weights = json.loads((tmp_path / "w8" / "config.json").read_text())["quantization_config"]
    assert weights["config_groups"]["group_0"]["weights"]["strategy"] == "channel"


BAD = {
    # argv after MODEL OUT: what the one line names
    "scheme": (["--scheme", "w3a16"], "--scheme w3a16"),
    "group_size": (["--group-size", "100"], "--group-size 100"),
    "method": (["--method", "awq"], "--method awq"),
    "group_not_dividing": (["--group-size", "128"], "model.layers.0.mlp.down_proj.weight has 704 input columns"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_flag_is_one_line_and_exit_2(sage, tmp_path, case):
    argv, must = BAD[case]
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "out"), *argv)
    assert done.code == 2 and must in _one_line(done.err)
    assert not (tmp_path / "out").exists()


def test_bad_directories_are_one_line_and_exit_2(sage, tmp_path):
    missing = sage("compress", "quantize", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert missing.code == 2 and "no config.json" in _one_line(missing.err)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    busy = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "full"), "--group-size", "32")
    assert busy.code == 2 and "exists and is not empty" in _one_line(busy.err)


def test_an_unsupported_quantized_checkpoint_is_one_line_and_exit_2(sage, tmp_path):
    out = tmp_path / "q"
    assert sage("compress", "quantize", str(DEMO_MODEL_DIR), str(out), "--scheme", "w8a16").code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (out / "config.json").write_text(json.dumps(config))
    gen = sage("llm", "generate", "--model", str(out), "--prompt", "x", "--max-tokens", "2")
    assert gen.code == 2
    line = _one_line(gen.err)
    assert "config.json: quantization_config.config_groups.group_0.weights.num_bits: 2 is not supported" in line
    again = sage("compress", "quantize", str(out), str(tmp_path / "twice"))
    assert again.code == 2 and "already quantized" in _one_line(again.err)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_quantize_takes_a_mixture_of_experts_experts_and_keeps_its_routers(sage, tmp_path, family):
    """Every expert (Mixtral's w1/w2/w3 too) and the shared expert quantized, routers and gates kept float: sage
    serves the copy with transformers' tokens on the same weights dequantized."""
    import shutil

    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from sage_infer import LLM
    from sage_infer.quantization.checkpoint import is_quantized_linear
    from sage_infer.quantization.weights import WeightScheme, quantize_rtn
    from tests.test_moe import GREEDY, assert_same_as_hf, hf_greedy, make_tiny_moe, prompts_with_a_shared_prefix

    make_tiny_moe(tmp_path / "float", family)
    done = sage("compress", "quantize", str(tmp_path / "float"), str(tmp_path / "w8"), "--scheme", "w8a16", "--json")
    assert done.code == 0, done.err
    tensors = load_file(str(tmp_path / "float" / "model.safetensors"))
    experts = [n for n in tensors if ".experts." in n or ".shared_expert." in n]
    assert experts and all(is_quantized_linear(n) for n in experts)
    assert json.loads(done.out)["quantized_layers"] == sum(is_quantized_linear(n) for n in tensors)
    with safe_open(str(tmp_path / "w8" / "model.safetensors"), "pt") as handle:
        written = set(handle.keys())
    routers = [n for n in tensors if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                                 "shared_expert_gate.weight"))]
    assert routers and all(n in written for n in routers)  # kept as they were
    assert not any(n in written for n in experts)  # replaced by their packed form
    dequantized = {n: quantize_rtn(t, WeightScheme(8)).dequantize(t.dtype).contiguous() if is_quantized_linear(n)
                   else t for n, t in tensors.items()}
    shutil.copytree(tmp_path / "float", tmp_path / "dequantized")
    save_file(dequantized, str(tmp_path / "dequantized" / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    prompts = prompts_with_a_shared_prefix(seed=7)[:2]
    llm = LLM(str(tmp_path / "w8"), dtype="fp32", num_blocks=64)
    assert_same_as_hf(hf_greedy(hf, prompts), llm.generate(prompts, GREEDY))
    llm.engine.shutdown()


def test_gptq_and_stacked_experts_are_refused_in_one_line(sage, tmp_path):
    from safetensors.torch import save_file

    from tests.test_moe import make_tiny_moe

    make_tiny_moe(tmp_path / "moe", "olmoe")
    done = sage("compress", "quantize", str(tmp_path / "moe"), str(tmp_path / "out"), "--method", "gptq")
    assert done.code == 2 and "GPTQ for them is not implemented yet" in _one_line(done.err)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((tmp_path / "moe" / "config.json").read_text())
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 32)}, str(stacked / "model.safetensors"))
    done = sage("compress", "quantize", str(stacked), str(tmp_path / "out2"))
    assert done.code == 2 and "experts stacked in one tensor are not implemented yet" in _one_line(done.err)
