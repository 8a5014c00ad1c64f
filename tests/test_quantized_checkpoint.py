"""Quantized checkpoints (compressed-tensors, weight-only int8 / int4): written by
`quantize_checkpoint`, loaded by the model loader into `QuantLinear`, run by the engine on the CPU
kernels with the same greedy tokens as the reference path; every quantization_config sage cannot
run is refused, naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.layers.linear import PackedLinear
from sage_infer.layers.quant_linear import Int4PackLinear, Int8PackLinear, QuantLinear
from sage_infer.models.loader import DEMO_MODEL_DIR, ModelLoadError, load_model
from sage_infer.quantization.checkpoint import quantize_checkpoint
from sage_infer.quantization.compressed_tensors import FormatError, parse_config, quantization_config
from sage_infer.quantization.weights import WeightScheme, quantize_rtn

SCHEMES = {"w8": WeightScheme(8), "w4-g32": WeightScheme(4, 32), "w4-g64-asym": WeightScheme(4, 64, False)}
KERNEL = {"w8": Int8PackLinear, "w4-g32": Int4PackLinear, "w4-g64-asym": Int4PackLinear}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {name: quantize_checkpoint(DEMO_MODEL_DIR, root / name, scheme) and root / name
            for name, scheme in SCHEMES.items()}


def test_the_written_directory_is_a_complete_hf_model(checkpoints):
    out = checkpoints["w4-g32"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (DEMO_MODEL_DIR / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(SCHEMES["w4-g32"])
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings (tied lm_head) kept
    assert tensors["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    assert tensors["model.layers.0.mlp.down_proj.weight_packed"].shape == (256, 704 // 8)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (256, 704 // 32)
    assert not any(name.endswith("proj.weight") for name in tensors)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_loading_gives_the_weights_that_were_quantized(checkpoints, name):
    model, _, _ = load_model(checkpoints[name])
    original = load_file(str(DEMO_MODEL_DIR / "model.safetensors"))
    layer = model.model.layers[1].self_attn.o_proj
    assert type(layer) is QuantLinear
    want = quantize_rtn(original["model.layers.1.self_attn.o_proj.weight"], SCHEMES[name])
    assert torch.equal(layer.qweight, want.qweight) and torch.equal(layer.weight_scale, want.scale)
    assert (layer.weight_zero_point is None) == (want.zero_point is None)
    if want.zero_point is not None:
        assert torch.equal(layer.weight_zero_point, want.zero_point)
    assert model.model.layers[1].self_attn.o_proj.weight_scale.dtype == torch.bfloat16


def engine(path, linear: str, dtype: str = "fp32") -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "linear": linear, "dtype": dtype},
                                         "kv_pool": {"num_blocks": 64}})
    return LLM(config=config)


PROMPTS = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 40))]
NEAR_TIE = 0.1  # nats


def assert_same_greedy_tokens_but_near_ties(prompts, got, want, reference: LLM) -> None:
    """Token for token equal; where a bf16 run forks, the two tokens are within NEAR_TIE nats in the
    fp32 reference (two kernels may round a near tie apart in bf16, never a clear choice)."""
    for prompt, a, b in zip(prompts, got, want):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top = dict(reference.generate([prompt + a[:k]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
                   .outputs[0].logprobs[0][1])
        assert a[k] in top and b[k] in top and abs(top[a[k]] - top[b[k]]) < NEAR_TIE, (k, a, b, top)


@pytest.mark.parametrize("name, dtype", [("w8", "fp32"), ("w8", "bf16"), ("w4-g64-asym", "bf16")])
def test_the_engine_on_cpu_kernels_gives_the_reference_paths_greedy_tokens(checkpoints, name, dtype):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fast, ref = engine(checkpoints[name], "auto", dtype), engine(checkpoints[name], "torch", dtype)
    fast_model, ref_model = fast.engine.runner.model, ref.engine.runner.model
    assert type(fast_model.model.layers[0].mlp.gate_proj) is KERNEL[name]
    assert type(ref_model.model.layers[0].mlp.gate_proj) is QuantLinear
    assert isinstance(fast_model.lm_head, PackedLinear)  # tied to the embeddings: never quantized, packed as a copy
    assert isinstance(ref_model.lm_head, torch.nn.Linear)
    got = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, greedy)]
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, greedy)]
    if dtype == "fp32":
        assert got == want
    else:
        assert_same_greedy_tokens_but_near_ties(PROMPTS, got, want, engine(checkpoints[name], "torch", "fp32"))


def test_unquantized_linears_of_a_quantized_model_are_still_packed(tmp_path):
    from tests.tiny_models import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "qwen2")  # untied lm_head, q/k/v biases
    quantize_checkpoint(src, tmp_path / "q", WeightScheme(8))
    llm = engine(tmp_path / "q", "auto")
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, PackedLinear)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is Int8PackLinear and q_proj.bias is not None and bool(q_proj.bias.any())


def _with_config(tmp_path, checkpoint, edit) -> str:
    target = tmp_path / "edited"
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    edit(config["quantization_config"])
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def _weights(qc):
    return qc["config_groups"]["group_0"]["weights"]


UNSUPPORTED = {
    # name: (edit of quantization_config, field named in the error)
    "gptq_method": (lambda qc: qc.update(quant_method="gptq"), "quantization_config.quant_method"),
    "activations": (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
        "quantization_config.config_groups.group_0.input_activations"),
    "fp8": (lambda qc: _weights(qc).update(type="float", num_bits=8), "quantization_config.config_groups.group_0"
            ".weights.type"),
    "two_bits": (lambda qc: _weights(qc).update(num_bits=2), "quantization_config.config_groups.group_0.weights"
                 ".num_bits"),
    "tensor_strategy": (lambda qc: _weights(qc).update(strategy="tensor"), "quantization_config.config_groups"
                        ".group_0.weights.strategy"),
    "act_order_group": (lambda qc: _weights(qc).update(actorder="group"), "quantization_config.config_groups"
                        ".group_0.weights.actorder"),
    "kv_cache_scheme": (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                        "quantization_config.kv_cache_scheme"),
    "marlin_format": (lambda qc: qc.update(format="marlin-24") or qc["config_groups"]["group_0"].pop("format"),
                      "quantization_config.format"),
    "frozen": (lambda qc: qc.update(quantization_status="frozen"), "quantization_config.quantization_status"),
    "class_target": (lambda qc: qc["config_groups"]["group_0"].update(targets=["Embedding"]),
                     "quantization_config.config_groups.group_0.targets"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_an_unsupported_quantization_config_is_a_load_error_naming_the_field(checkpoints, tmp_path, case):
    edit, field = UNSUPPORTED[case]
    path = _with_config(tmp_path, checkpoints["w4-g32"], edit)
    with pytest.raises(ModelLoadError, match=f"config.json: {field}:"):
        load_model(path)


def test_parse_config_reads_what_it_writes():
    for scheme in SCHEMES.values():
        (group,) = parse_config(quantization_config(scheme)).groups
        assert group.scheme == scheme and group.format == "pack-quantized"
    with pytest.raises(FormatError, match="quantization_config.config_groups: expected"):
        parse_config({"quant_method": "compressed-tensors", "format": "pack-quantized"})


def test_a_missing_or_misshapen_quantized_tensor_is_a_load_error_naming_it(checkpoints, tmp_path):
    target = tmp_path / "broken"
    shutil.copytree(checkpoints["w4-g32"], target)
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight_scale"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.2.mlp.up_proj.weight_scale: missing"):
        load_model(target)
    tensors = load_file(str(checkpoints["w4-g32"] / "model.safetensors"))
    tensors["model.layers.3.mlp.up_proj.weight_packed"] = tensors["model.layers.3.mlp.up_proj.weight_packed"][:5]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.layers.3.mlp.up_proj.weight_packed: shape \(5, 32\), "
                       r"expected \(704, 32\)"):
        load_model(target)


def test_a_sharded_checkpoint_keeps_its_shards_and_loads(tmp_path):
    import transformers

    from tests.tiny_models import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "qwen3")
    transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(src, max_shard_size="100KB")
    (src / "model.safetensors").unlink(missing_ok=True)
    source_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(source_map.values())) > 1
    quantize_checkpoint(src, tmp_path / "q", WeightScheme(4, 32))
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    down = "model.layers.1.mlp.down_proj"
    assert index[f"{down}.weight_packed"] == index[f"{down}.weight_scale"] == source_map[f"{down}.weight"]
    model, _, _ = load_model(tmp_path / "q")
    original = {}
    for shard in set(source_map.values()):
        original.update(load_file(str(src / shard)))
    assert torch.equal(model.get_submodule(down).qweight,
                       quantize_rtn(original[f"{down}.weight"], WeightScheme(4, 32)).qweight)
