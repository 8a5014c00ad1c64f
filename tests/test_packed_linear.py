"""`model.linear`: oneDNN-prepacked linear layers against `nn.Linear`, the reference path.

fp32: the same numbers to rounding, and the engine's greedy tokens identical with either path (the
engine-vs-transformers tests run the packed path too, since auto packs on a CPU). bf16: within bf16
rounding of the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.engine.build import use_packed_linears
from sage_infer.errors import ConfigError
from sage_infer.layers import linear as linear_module
from sage_infer.layers.cpu_kernels import bf16_rows_linear, kernel_unavailable
from sage_infer.layers.linear import PackedLinear, pack_linears, packing_available, tied_linear_bytes
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN (mkldnn) linear")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_nn_linear(dtype, tol, bias, rows):
    torch.manual_seed(rows)
    ref = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(ref)
    x = torch.randn(rows, 96, dtype=dtype)
    want, got = ref(x), packed(x)
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= tol * scale
    assert torch.equal(packed(x.view(1, rows, 96)).view(rows, 160), got)  # leading dims are flattened


def test_pack_linears_packs_a_tied_head_as_a_copy_and_the_embedding_keeps_its_weight():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    weight = model.embed.weight.detach().clone()
    x = torch.randn(3, 16)
    want = model.head(x)
    assert tied_linear_bytes(model) == 50 * 16 * 4
    assert pack_linears(model) == 2
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
    assert torch.equal(model.embed.weight, weight)  # lookups still read the original rows
    torch.testing.assert_close(model.head(x), want, atol=1e-5, rtol=1e-5)
    assert tied_linear_bytes(model) == 0  # nothing left to duplicate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("packed") / "m", "qwen2")


def engine(path, linear: str, dtype: str = "fp32") -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "linear": linear, "dtype": dtype},
                                         "kv_pool": {"num_blocks": 64}})
    return LLM(config=config)


def test_the_engine_gives_the_same_greedy_tokens_packed_or_not(tiny):
    prompts = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 40, 64))]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    packed, plain = engine(tiny, "packed"), engine(tiny, "torch")
    layers = packed.engine.runner.model.model.layers
    assert isinstance(layers[0].mlp.gate_up_proj, PackedLinear)
    assert isinstance(layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(plain.engine.runner.model.model.layers[0].mlp.gate_proj, nn.Linear)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, greedy)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    assert got == want


def test_auto_packs_on_a_cpu_and_packed_elsewhere_is_a_config_error(tiny):
    assert isinstance(engine(tiny, "auto").engine.runner.model.lm_head, PackedLinear)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="model.linear"):
        use_packed_linears(model, "packed", torch.device("cuda"))
    use_packed_linears(model, "auto", torch.device("cuda"))  # auto elsewhere: left as it is
    assert isinstance(model[0], nn.Linear)


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16, 64])
def test_bf16_weights_that_onednn_cannot_pack_compute_in_fp32_copies(rows, monkeypatch):
    """What a CPU without bf16 packing (AVX2) runs, forced on any CPU: fp32 products of an fp32 copy, rounded
    to bf16; up to `bf16_rows` rows on the kept bf16 weight (sage's kernel, or torch's product without it)."""
    monkeypatch.setattr(linear_module, "packing_unavailable", lambda dtype: "no bf16 packing (forced by the test)")
    torch.manual_seed(rows)
    ref = nn.Linear(96, 160).to(torch.bfloat16)
    packed = PackedLinear(ref)
    assert packed.weight_bf16 is not None and packed.bias.dtype == torch.float32
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 160)
    if rows <= packed.bf16_rows and not packed.rows_kernel:
        assert torch.equal(got, ref(x))  # the same product on the same bf16 weight
    elif rows <= packed.bf16_rows:  # sage's kernel: fp32 sums in another order, rounded to bf16 once
        torch.testing.assert_close(got.float(), ref(x).float(), atol=1e-2, rtol=8e-3)
    else:  # fp32 math on the same values: within one bf16 rounding of the fp32 result
        want = torch.nn.functional.linear(x.float(), ref.weight.float(), ref.bias.float())
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16])  # passes of 1-6 rows, 2 and 3 passes
@pytest.mark.parametrize("n, k", [(160, 96), (37, 100), (64, 4864)])  # K with a tail under 16; a long K
@pytest.mark.parametrize("bias", [True, False])
def test_the_bf16_rows_kernel_equals_torchs_bf16_product_to_rounding(cpu_isa, rows, n, k, bias):
    torch.manual_seed(rows * n + k)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    got = bf16_rows_linear(x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    want = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # the same fp32 products summed in another order, each rounded to bf16 once: within a bf16 unit, and
    # against the exact (fp64) sum closer than bf16's half unit plus fp32 summation error
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(),
                                       None if layer.bias is None else layer.bias.double())
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")
def test_the_bf16_rows_kernel_refuses_what_it_does_not_take():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        bf16_rows_linear(torch.randn(17, 16, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="bf16"):
        bf16_rows_linear(torch.randn(1, 16), w)
