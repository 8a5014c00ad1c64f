"""`model.decode_linear: sage`: sage's bf16 kernel for products of a few rows (csrc/small_linear.cpp),
reading the weights oneDNN packed for `PackedLinear` in place, against oneDNN on the same weights and
against fp32 arithmetic. Both accumulate in fp32 and round once to bf16, so they differ by summation
order only. Skipped where the kernel cannot run (no AVX512-BF16, no compiler): each test says why."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from sage_infer import LLM
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError
from sage_infer.layers import linear as linear_mod
from sage_infer.layers.cpu_kernels import packed_layout_matches, small_linear, small_linear_unavailable
from sage_infer.layers.linear import SMALL_LINEAR_ROWS, SMALL_LINEAR_ROWS_AMX, PackedLinear, packing_available
from tests.packed_layout import pack_blocks, packed_bf16_layout, packed_block_rows
from tests.tiny_models import assert_within_bf16_drift, greedy_tokens, make_tiny_model

WHY = "this torch has no oneDNN (mkldnn) linear" if not packing_available() else small_linear_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"sage's small-row kernel cannot run here: {WHY}")


LAYOUT = WHY or packed_bf16_layout()
# the rows a layer takes on the kernel here: fewer where oneDNN packs for AMX tiles
ROWS_HERE = SMALL_LINEAR_ROWS if packed_block_rows() == 64 else SMALL_LINEAR_ROWS_AMX
needs_layout = pytest.mark.skipif(LAYOUT is not None, reason=f"the kernel cannot read the weights in place: {LAYOUT}")


def layers(fan_in: int, fan_out: int, bias: bool) -> tuple[nn.Linear, PackedLinear, PackedLinear]:
    torch.manual_seed(fan_in * 7 + fan_out)
    ref = nn.Linear(fan_in, fan_out, bias=bias).to(torch.bfloat16)
    return ref, PackedLinear(ref), PackedLinear(ref, small_rows=SMALL_LINEAR_ROWS)


# widths that fill whole 64-row blocks and 32-column pairs, and ones that leave padding in both
@needs_layout
@pytest.mark.parametrize("fan_in, fan_out", [(896, 1152), (30, 100), (1000, 33), (64, 64), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_matches_onednn_on_the_same_packed_weights(fan_in, fan_out, bias):
    ref, onednn, sage = layers(fan_in, fan_out, bias)
    assert sage.small_rows == ROWS_HERE  # oneDNN's layout was one of the kernel's for this weight
    for rows in (1, 3, 4, 5, 8, 17, SMALL_LINEAR_ROWS):  # the kernel itself, past the layer's limit too
        x = torch.randn(rows, fan_in, dtype=torch.bfloat16)
        exact = x.float() @ ref.weight.float().T + (ref.bias.float() if bias else 0)
        got = small_linear(x, sage._address, sage._nbytes, fan_out, sage._bias32, sage._block_rows)
        want = onednn(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, fan_out)
        ulp = exact.abs().clamp(min=1e-3) * 2 ** -8  # one bf16 rounding step, plus fp32 summation order
        assert ((got.float() - exact).abs() <= ulp + 1e-4 * fan_in ** 0.5).all()
        assert ((got.float() - want.float()).abs() <= 2 * ulp + 1e-4 * fan_in ** 0.5).all()


@needs_layout
def test_rows_past_the_limit_and_fp32_weights_stay_on_onednn(monkeypatch):
    calls = []
    real = linear_mod.small_linear
    monkeypatch.setattr(linear_mod, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    _, onednn, sage = layers(96, 160, True)
    limit = sage.small_rows
    x = torch.randn(limit, 1, 96, dtype=torch.bfloat16)  # leading dims flatten: `limit` rows
    assert torch.equal(sage(x), sage(x.view(limit, 96)).view(limit, 1, 160))
    assert calls == [limit, limit]
    big = torch.randn(limit + 1, 96, dtype=torch.bfloat16)
    assert torch.equal(sage(big), onednn(big))  # oneDNN's own product, bit for bit
    assert calls == [limit, limit]
    fp32 = PackedLinear(nn.Linear(96, 160), small_rows=SMALL_LINEAR_ROWS)
    assert fp32.small_rows == 0
    assert fp32(torch.empty(0, 96)).shape == (0, 160)  # no rows: oneDNN's empty product, not the kernel
    assert onednn(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 160)
    assert calls == [limit, limit]


def test_the_layout_check_compares_the_bytes_not_just_the_size():
    _, onednn, _ = layers(96, 160, False)
    address, nbytes = torch.ops.mkldnn.data_ptr(onednn.packed), torch.ops.mkldnn._nbytes(onednn.packed)
    other = torch.randn(160, 96).to(torch.bfloat16)
    assert not packed_layout_matches(address, nbytes, other)  # same shape, other values
    assert not packed_layout_matches(address, nbytes, torch.zeros(161, 96, dtype=torch.bfloat16))


@pytest.mark.parametrize("fan_in, fan_out", [(96, 160), (30, 100), (1000, 33), (64, 64), (2, 3)])
def test_both_packed_layouts_are_found_and_give_the_same_bits(fan_in, fan_out):
    """Blocks of 64 rows (oneDNN on AVX512-BF16) and of 32 (oneDNN for AMX tiles), built here: the layout check
    names each (and neither for other values), and the kernel gives the same bits over either, which are within a
    rounding of fp32 arithmetic."""
    torch.manual_seed(fan_in + fan_out)
    weight = torch.randn(fan_out, fan_in).to(torch.bfloat16)
    bias = torch.randn(fan_out)
    x = torch.randn(7, fan_in).to(torch.bfloat16)
    outs = []
    for rows in (64, 32):
        packed = pack_blocks(weight, rows)
        address, nbytes = packed.data_ptr(), packed.numel() * 2
        found = packed_layout_matches(address, nbytes, weight)
        assert found == rows or (found == 64 and torch.equal(pack_blocks(weight, 64), packed)), (found, rows)
        assert not packed_layout_matches(address, nbytes, weight + 1)
        outs.append([small_linear(x[:m], address, nbytes, fan_out, bias, rows) for m in (1, 4, 7)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    exact = x.float() @ weight.float().T + bias
    assert (outs[1][2].float() - exact).abs().max() <= exact.abs().max() * 2 ** -7 + 1e-2


# -- the engine ---------------------------------------------------------------------------------


def engine(path, decode_linear: str, dtype: str = "bf16", linear: str = "auto", decode_step: str = "auto") -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype, "linear": linear,
                                                   "decode_linear": decode_linear, "decode_step": decode_step},
                                         "kv_pool": {"num_blocks": 96}})
    return LLM(config=config)


@needs_layout
def test_the_setting_decides_which_kernel_decode_steps_run(tmp_path, monkeypatch):
    """sage: every decode step's products go through the kernel (7 packed layers here: per layer q/k/v and
    gate/up stacked, o, down; then the lm_head); onednn: none do. A prefill of more rows than the limit
    stays on oneDNN, but for its lm_head, which reads the last position only. (Layer by layer from Python,
    where the products are seen: `model.decode_step: sage` makes the same calls in C++, tests/test_decode_step.py.)"""
    calls = []
    real = linear_mod.small_linear
    monkeypatch.setattr(linear_mod, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    prompt = [[5 + i for i in range(SMALL_LINEAR_ROWS + 8)]]
    greedy_tokens(engine(path, "onednn"), prompt, max_tokens=3)
    assert calls == []
    greedy_tokens(engine(path, "sage", decode_step="python"), prompt, max_tokens=3)
    assert calls == [1] * (1 + 2 * (2 * 4 + 1))  # prefill's lm_head, 2 decode steps x (2 layers x 4 + lm_head)


@needs_layout
def test_bf16_greedy_tokens_agree_with_onednn_within_drift(tmp_path):
    path = make_tiny_model(tmp_path / "q2", "qwen2")  # q/k/v bias: the kernel's bias path
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 20, 40, 64, 100, 130, 8, 50)]
    got = greedy_tokens(engine(path, "sage"), prompts)
    want = greedy_tokens(engine(path, "onednn"), prompts)
    assert_within_bf16_drift(got, want)


def test_sage_where_it_cannot_run_is_a_config_error_and_auto_falls_back(tmp_path):
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    with pytest.raises(ConfigError, match=r"^model.decode_linear: sage: the kernel is bf16-only \(the model is fp32\)"):
        engine(path, "sage", dtype="fp32")
    with pytest.raises(ConfigError, match="^model.decode_linear: sage runs on packed weights; model.linear is torch"):
        engine(path, "sage", linear="torch")
    fp32 = engine(path, "auto", dtype="fp32")
    assert all(m.small_rows == 0 for m in fp32.engine.runner.model.modules() if isinstance(m, PackedLinear))
    bf16 = engine(path, "auto")  # the kernel where oneDNN's layout is its own, else oneDNN
    want = ROWS_HERE if LAYOUT is None else 0
    assert all(m.small_rows == want for m in bf16.engine.runner.model.modules() if isinstance(m, PackedLinear))
    if LAYOUT is not None:
        with pytest.raises(ConfigError, match="^model.decode_linear: sage: oneDNN packed no layer in the kernel's "):
            engine(path, "sage")
