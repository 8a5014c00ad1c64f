"""GPTQ: column-by-column quantization with inverse-Hessian error feedback, against round-to-nearest
on the demo model's calibration inputs (the layer output error it exists to reduce)."""

from __future__ import annotations

import json

import pytest
import torch

from sage_infer.models.loader import DEMO_MODEL_DIR
from sage_infer.quantization.gptq import gptq_quantize, hessian_source, output_error
from sage_infer.quantization.weights import WeightScheme, quantize_rtn


@pytest.fixture(scope="module")
def demo_hessians():
    """Weights (bf16, as shipped) and input Hessians of layers 0 and 3 from 16 calibration windows."""
    import transformers

    from sage_infer.quantization.calibration import calibration_batches, collect_hessians

    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    names = [f"model.layers.{i}.{m}" for i in (0, 3) for m in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj")]
    hessians = collect_hessians(model, calibration_batches(tokenizer, 16, 128), sorted({hessian_source(n)
                                                                                         for n in names}))
    weights = {n: model.get_submodule(n).weight.detach().to(torch.bfloat16) for n in names}
    return weights, {n: hessians[hessian_source(n)] for n in names}


@pytest.mark.parametrize("scheme", [WeightScheme(4, 32), WeightScheme(4, 64, False), WeightScheme(8)],
                         ids=lambda s: s.name)
def test_gptq_output_error_is_lower_than_rtns_on_every_layer(demo_hessians, scheme):
    weights, hessians = demo_hessians
    for name, weight in weights.items():
        rtn = output_error(weight, quantize_rtn(weight, scheme), hessians[name])
        gptq = gptq_quantize(weight, hessians[name], scheme)
        assert gptq.scale.dtype == torch.bfloat16 and gptq.qweight.dtype == torch.int8
        assert output_error(weight, gptq, hessians[name]) < 0.7 * rtn, name


def test_with_an_identity_hessian_there_is_nothing_to_compensate_and_gptq_is_rtn():
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    for scheme in (WeightScheme(4, 32), WeightScheme(4, 64, False), WeightScheme(8)):
        gptq, rtn = gptq_quantize(weight, torch.eye(128), scheme), quantize_rtn(weight, scheme)
        assert torch.equal(gptq.qweight, rtn.qweight) and torch.equal(gptq.scale, rtn.scale)


def test_k_v_and_up_projections_share_their_neighbours_hessian():
    assert hessian_source("model.layers.2.self_attn.v_proj") == "model.layers.2.self_attn.q_proj"
    assert hessian_source("model.layers.2.mlp.up_proj") == "model.layers.2.mlp.gate_proj"
    assert hessian_source("model.layers.2.mlp.down_proj") == "model.layers.2.mlp.down_proj"


def test_sage_compress_quantize_gptq_writes_a_loadable_checkpoint(sage, tmp_path):
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "g"), "--scheme", "w4a16",
                "--group-size", "64", "--method", "gptq", "--calib-samples", "4", "--calib-seq-len", "64", "--json")
    assert done.code == 0, done.err
    report = json.loads(done.out)
    assert report["method"] == "gptq" and report["calibration_tokens"] == 4 * 64
    gen = sage("llm", "generate", "--model", str(tmp_path / "g"), "--prompt", "KING:", "--max-tokens", "4",
               "--temperature", "0", "--json")
    assert gen.code == 0, gen.err
    rtn = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "r"), "--calib-samples", "4")
    assert rtn.code == 2 and "apply to --method gptq only" in rtn.err
