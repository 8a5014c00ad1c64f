"""The fused elementwise ops (`model.elementwise: fused`, csrc/fused_ops.cpp) against their PyTorch
references: each op alone on strided views in fp32/bf16/fp16, then greedy tokens of the engine."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from sage_infer import LLM
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError
from sage_infer.layers import cpu_kernels as kernels
from sage_infer.layers.norm import RMSNorm
from sage_infer.layers.rotary import RotaryEmbedding, apply_rotary
from tests.tiny_models import assert_within_bf16_drift, greedy_tokens, make_tiny_model

# at every ISA level this CPU runs (conftest.cpu_isa)
pytestmark = [pytest.mark.skipif(kernels.kernel_unavailable() is not None,
                                reason=f"CPU kernels: {kernels.kernel_unavailable()}"),
              pytest.mark.usefixtures("cpu_isa")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: summation order only (a few ulps); bf16/fp16: the same roundings as the reference, so at
    most one unit in the last place where a reordered fp32 sum lands on the other side of a tie."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:
        torch.testing.assert_close(got, want)  # dtype defaults: 1 ulp
        assert (got != want).float().mean() < 0.01


def norm_with(width: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(width, 1e-5).to(dtype)
    norm.weight.data = torch.randn(width).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_add_before_it_equal_the_reference_on_strided_rows(dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 2 * 96).to(dtype)[:, 96:]  # every row strided
    norm = norm_with(96, dtype)
    close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
    residual = torch.randn(37, 96).to(dtype)
    before = residual.clone()
    out = kernels.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, before + x)  # the add rounds as PyTorch's does
    close(out, norm(before + x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_of_gate_times_up(dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(2, 19, 2 * 80).to(dtype)[1]
    gate, up = gate_up.chunk(2, dim=-1)
    close(kernels.silu_mul(gate_up), F.silu(gate) * up)
    strided = torch.randn(5, 300).to(dtype)[:, :200]  # rows 300 apart
    close(kernels.silu_mul(strided), F.silu(strided[:, :100]) * strided[:, 100:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_in_passes_of_rows_equals_one_pass(dtype, monkeypatch):
    """Prefill rows go through the fused MLP (`FusedOps.gated_mlp`) in passes that bound the gate/up buffer: the
    passes (the last one short) give what one pass over all rows gives, and the reference ops."""
    from sage_infer.layers import elementwise
    from sage_infer.models import llama

    torch.manual_seed(2)
    mlp = llama.MLP(type("Cfg", (), {"hidden_size": 64, "intermediate_size": 96, "mlp_bias": False})())
    mlp = mlp.to(dtype)
    assert mlp.fuse_projections()
    x = torch.randn(300, 64).to(dtype)
    whole = mlp(x, elementwise.FUSED_OPS)
    monkeypatch.setattr(elementwise, "MLP_PASS_MIN_ROWS", 1)
    monkeypatch.setattr(elementwise, "MLP_PASS_BYTES", 128 * 96 * 2 * 4)  # 128 rows per pass: 128, 128, 44
    assert elementwise.pass_rows(96) == 128
    close(mlp(x, elementwise.FUSED_OPS), whole)
    close(mlp(x, elementwise.FUSED_OPS), mlp(x, elementwise.TORCH_OPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_in_place_equals_apply_rotary_and_leaves_the_rest_of_the_row(dtype, head_dim):
    torch.manual_seed(2)
    rotary = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}, 4096)
    positions = torch.tensor([0, 1, 5, 100, 2047, 7])
    cos, sin = rotary.cos_sin(positions, dtype)
    qkv = torch.randn(6, 6 + 2 + 2, head_dim).to(dtype)  # q (6 heads), k (2), v (2) side by side
    got = qkv.clone()
    kernels.rope_(got[:, :8], cos[:, 0], sin[:, 0])
    close(got[:, :8], apply_rotary(qkv[:, :8], cos, sin))
    assert torch.equal(got[:, 8:], qkv[:, 8:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_after_each_heads_norm_equals_qwen3s_q_norm_then_rotary(dtype):
    torch.manual_seed(3)
    rotary = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e6}, 4096)
    cos, sin = rotary.cos_sin(torch.arange(9) * 3, dtype)
    qkv = torch.randn(9, 4 + 2 + 2, 64).to(dtype)
    q_norm, k_norm = norm_with(64, dtype), norm_with(64, dtype)
    got = qkv.clone()
    kernels.rope_(got[:, :4], cos[:, 0], sin[:, 0], q_norm.weight, q_norm.eps)
    kernels.rope_(got[:, 4:6], cos[:, 0], sin[:, 0], k_norm.weight, k_norm.eps)
    close(got[:, :4], apply_rotary(q_norm(qkv[:, :4]), cos, sin))
    close(got[:, 4:6], apply_rotary(k_norm(qkv[:, 4:6]), cos, sin))
    assert torch.equal(got[:, 6:], qkv[:, 6:])


def test_bad_shapes_are_errors_not_wrong_answers():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.silu_mul(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="cos and signed_sin"):
        kernels.rope_(torch.randn(3, 2, 8), torch.ones(2, 8), torch.ones(2, 8))


# -- the engine ---------------------------------------------------------------------------------


def engine(path, elementwise: str, dtype: str = "fp32", decode_step: str = "auto", **scheduler) -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype, "elementwise": elementwise,
                                                   "decode_step": decode_step},
                                         "kv_pool": {"num_blocks": 96}, "scheduler": scheduler})
    return LLM(config=config)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])  # q/k norm; q/k/v bias; llama3 rope scaling
def test_fp32_greedy_tokens_are_identical_fused_and_reference(tmp_path, arch):
    path = make_tiny_model(tmp_path / arch, arch)
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 9, 16, 40, 77, 130)]
    fused = engine(path, "auto")
    assert fused.engine.runner.step.ops.name == "fused"
    reference = engine(path, "torch")
    assert reference.engine.runner.step.ops.name == "torch"
    assert greedy_tokens(fused, prompts) == greedy_tokens(reference, prompts)
    # chunked prefill: a sequence's prompt split over steps, decode rows beside prefill rows
    chunked = engine(path, "fused", max_num_batched_tokens=24, max_num_seqs=4)
    assert greedy_tokens(chunked, prompts) == greedy_tokens(reference, prompts)


def test_bf16_greedy_tokens_agree_with_the_reference_within_drift(tmp_path):
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 20, 40, 64, 100, 130, 8, 50)]
    got = greedy_tokens(engine(path, "fused", dtype="bf16"), prompts)
    want = greedy_tokens(engine(path, "torch", dtype="bf16"), prompts)
    assert_within_bf16_drift(got, want)


def test_fused_where_it_cannot_run_is_a_config_error_and_auto_falls_back():
    from sage_infer.engine.build import use_fused_elementwise

    with pytest.raises(ConfigError, match="^model.elementwise: fused: the fused ops are CPU-only"):
        use_fused_elementwise("fused", torch.device("meta"))
    assert use_fused_elementwise("auto", torch.device("meta")) is False
    assert use_fused_elementwise("torch", torch.device("cpu")) is False


def test_the_setting_decides_which_ops_run(tmp_path, monkeypatch):
    """fused runs the C++ passes (two residual-add norms per layer each step); torch runs none of them. (Layer
    by layer from Python, where the calls are seen: `model.decode_step: sage` makes the same ones in C++.)"""
    from sage_infer.models import llama

    calls = []
    real = llama.kernels.add_rms_norm_
    monkeypatch.setattr(llama.kernels, "add_rms_norm_", lambda *a: calls.append(1) or real(*a))
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    greedy_tokens(engine(path, "torch"), [[7, 8, 9]], max_tokens=3)
    assert calls == []
    greedy_tokens(engine(path, "fused", decode_step="python"), [[7, 8, 9]], max_tokens=3)
    assert len(calls) == 2 * 2 * 3  # 2 layers x 2 norms x 3 steps (prefill + 2 decodes)
