"""The grouped-experts kernel (csrc/moe_experts.cpp: all active experts of a step in one call) against the
reference grouped loop (`run_grouped` over PyTorch products on the stacked weights), at every ISA level, on each
layout it reads: the stacked weights (bf16, fp32), each expert's plain linears, and oneDNN's packed bf16 weights;
decode-sized steps (a few rows per expert) and prefill-sized ones (tens of rows per expert); gpt-oss's experts
(biases, clamped SwiGLU) against their PyTorch products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sage_infer.layers import cpu_kernels, moe
from sage_infer.layers.cpu_kernels import kernel_unavailable
from sage_infer.layers.elementwise import FUSED_OPS
from sage_infer.layers.linear import pack_linears
from sage_infer.layers.moe import FusedExperts, group_by_expert, run_grouped, run_routed
from sage_infer.layers.moe_grouped import (
    GROUPED_KERNEL_ROWS,
    MXFP4_BF16_ROWS,
    MXFP4_BF16_ROWS_AVX2,
    PACKED_AMX_ROWS,
    PLAIN_BF16_ROWS,
    PLAIN_BF16_ROWS_AVX2,
    PLAIN_FP32_ROWS,
    PLAIN_FP32_ROWS_AVX2,
    GroupedExpertWeights,
)
from sage_infer.layers.moe_swiglu import ClampedSwigluExperts
from tests.packed_layout import pack_blocks, packed_bf16_layout

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")

E, H, K = 8, 96, 3
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


PACKED_LAYOUT = packed_bf16_layout()


def skip_packed_unless_readable(layout: str) -> None:
    if layout == "packed" and PACKED_LAYOUT is not None:
        pytest.skip(PACKED_LAYOUT)


def make_experts(dtype: torch.dtype, inter: int, seed: int = 0) -> FusedExperts:
    torch.manual_seed(seed)
    experts = FusedExperts(E, H, inter).requires_grad_(False)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.15)
        experts.down_proj.normal_(0, 0.15)
    return experts.to(dtype)


def reference(experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, groups) -> torch.Tensor:
    gate_up, down = experts.gate_up_proj, experts.down_proj

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])

    return run_grouped(x, weights, groups, expert)


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's K distinct experts among E - 3 (so some experts get no row), and its weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 3, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), dim=-1)
    return weights, ids


def with_layout(experts: FusedExperts, layout: str) -> FusedExperts:
    """`experts` as the engine may hold them: stacked, each expert's nn.Linear pair, or packed by oneDNN."""
    if layout != "stacked":
        experts.split_linears()
    if layout == "packed":
        pack_linears(experts, small_rows=32 if cpu_kernels.small_linear_unavailable() is None else 0)
    return experts


@pytest.mark.parametrize("dtype,layout,inter", [
    (torch.float32, "stacked", 40), (torch.bfloat16, "stacked", 40), (torch.float32, "linears", 72),
    (torch.bfloat16, "packed", 40), (torch.bfloat16, "packed", 128)])
def test_the_grouped_kernel_equals_the_per_expert_loop(cpu_isa, dtype, layout, inter):
    skip_packed_unless_readable(layout)
    experts = make_experts(dtype, inter)
    want_experts = make_experts(dtype, inter)  # the same weights, kept stacked for the reference
    with_layout(experts, layout)
    kernel = experts.grouped_kernel()
    assert isinstance(kernel, GroupedExpertWeights), kernel
    assert bool(kernel.packed) == (layout == "packed")
    experts.kernel_rows = 1 << 20  # the kernel at any rows per expert, whatever the level's default
    for tokens, seed in ((1, 0), (5, 1), (9, 2), (47, 4)):  # 47 tokens: tens of rows per expert (a prefill chunk)
        weights, ids = routing(tokens, seed)
        groups = group_by_expert(ids, E)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
        with torch.no_grad():
            got = experts(x, weights.to(dtype), groups, FUSED_OPS)
            want = reference(want_experts, x, weights.to(dtype), groups)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_every_active_expert_runs_in_one_call_prefill_steps_too(monkeypatch):
    experts = make_experts(torch.float32, 40)
    experts.kernel_rows = 1 << 20  # any rows per expert (plain fp32's own limit is PLAIN_FP32_ROWS)
    calls = []
    real = cpu_kernels.moe_experts

    def counting(rows, spans, *args):
        calls.append(spans.tolist())
        return real(rows, spans, *args)

    monkeypatch.setattr(cpu_kernels, "moe_experts", counting)
    with torch.no_grad():
        for tokens in (6, 40):  # a decode step and a prefill chunk (up to 40 pairs on an expert)
            weights, ids = routing(tokens, 3)
            groups = group_by_expert(ids, E)
            experts(torch.randn(tokens, H), weights, groups, FUSED_OPS)
            assert calls[-1] == [list(span) for span in groups.spans]  # one call, every active expert's span
        assert max(groups.counts) > GROUPED_KERNEL_ROWS and len(calls) == 2
        experts.kernel_rows = max(groups.counts) - 1  # experts with more rows than the kernel is let take run alone
        experts(torch.randn(40, H), weights, groups, FUSED_OPS)
    assert len(calls) == 3
    assert [e for e, _, _ in calls[-1]] == [e for e, n in enumerate(groups.counts) if 0 < n <= experts.kernel_rows]


def test_many_rows_per_expert_go_to_the_kernel_unless_onednn_multiplies_them_faster(cpu_isa):
    """Packed bf16: decode steps only, unless the kernels sum bf16 pairs natively (in oneDNN's AMX layout up to
    PACKED_AMX_ROWS pairs an expert); plain fp32: up to
    PLAIN_FP32_ROWS pairs an expert (16-lane FMA) or PLAIN_FP32_ROWS_AVX2; plain bf16: up to PLAIN_BF16_ROWS (or
    the AVX2 level's) where oneDNN multiplies bf16."""
    plain = make_experts(torch.bfloat16, 40).grouped_kernel()
    wide = cpu_isa != "avx2"
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert plain.max_rows() == ((PLAIN_BF16_ROWS if wide else PLAIN_BF16_ROWS_AVX2) if onednn_bf16 else None)
    fp32 = make_experts(torch.float32, 40).grouped_kernel()
    assert fp32.max_rows() == (PLAIN_FP32_ROWS if wide else PLAIN_FP32_ROWS_AVX2)
    packed = GroupedExpertWeights(64, torch.bfloat16, 40, plain.gate_up, plain.down, [])
    native = cpu_kernels.moe_experts_native_bf16()
    assert packed.max_rows() == (None if native else GROUPED_KERNEL_ROWS)
    amx = GroupedExpertWeights(32, torch.bfloat16, 40, plain.gate_up, plain.down, [])  # oneDNN's AMX layout
    assert amx.max_rows() == PACKED_AMX_ROWS


def test_experts_past_the_kernels_limit_run_alone_and_the_rest_in_one_call(monkeypatch):
    """A step where some experts have more pairs than the kernel's limit: those run one product each, the others
    still in one kernel call (their rows gathered, spans renumbered); together the reference's outputs."""
    experts = make_experts(torch.float32, 40)
    weights, ids = routing(12, 3)
    groups = group_by_expert(ids, E)
    experts.kernel_rows = min(n for n in groups.counts if n)  # the experts with the fewest pairs on the kernel
    few = [e for e, n in enumerate(groups.counts) if 0 < n <= experts.kernel_rows]
    many = [e for e, n in enumerate(groups.counts) if n > experts.kernel_rows]
    assert few and many
    calls, alone = [], []
    real, real_expert = cpu_kernels.moe_experts, experts.expert
    monkeypatch.setattr(cpu_kernels, "moe_experts", lambda rows, spans, *a: calls.append(spans.tolist())
                        or real(rows, spans, *a))
    monkeypatch.setattr(experts, "expert", lambda e, rows, ops: alone.append(e) or real_expert(e, rows, ops))
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = experts(x, weights, groups, FUSED_OPS)
        want = reference(make_experts(torch.float32, 40), x, weights, groups)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert len(calls) == 1 and [e for e, _, _ in calls[0]] == few
    assert [end - start for _, start, end in calls[0]] == [groups.counts[e] for e in few]
    assert calls[0][0][1] == 0 and all(a[2] == b[1] for a, b in zip(calls[0], calls[0][1:]))
    assert alone == many


@pytest.mark.parametrize("inter", [40, 128])
def test_both_packed_layouts_give_the_same_bits(cpu_isa, inter):
    """Experts packed in blocks of 64 rows (oneDNN on AVX512-BF16) and of 32 (oneDNN for AMX tiles), built here: the
    same bits from either at every ISA level, decode- and prefill-sized, within bf16 rounding of the reference."""
    experts = make_experts(torch.bfloat16, inter)
    options = cpu_kernels.moe_options(torch.bfloat16, None, None, None, None)
    weights, ids = routing(47, 4)
    groups = group_by_expert(ids, E)
    x = torch.randn(47, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    rows = x.index_select(0, groups.tokens).contiguous()
    spans = torch.tensor(groups.spans, dtype=torch.long)
    outs = []
    for block in (64, 32):
        held = [[pack_blocks(w[e], block) for e in range(E)] for w in (experts.gate_up_proj, experts.down_proj)]
        addresses = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.long) for ts in held]
        outs.append(cpu_kernels.moe_experts(rows, spans, *addresses, inter, block, options))
    assert torch.equal(outs[0], outs[1])
    with torch.no_grad():
        want = reference(experts, x, weights.to(torch.bfloat16), groups)
        got = run_grouped(x, weights.to(torch.bfloat16), groups, None, lambda r, s: outs[1])
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.skipif(cpu_kernels.small_linear_unavailable() is not None, reason="needs small_linear (AVX512-BF16)")
def test_packed_bf16_experts_give_the_per_expert_kernels_bits():
    """On AVX512-BF16 the grouped kernel sums each product as small_linear does and SiLU * up as silu_mul does."""
    skip_packed_unless_readable("packed")
    experts = with_layout(make_experts(torch.bfloat16, 128), "packed")
    assert isinstance(experts.grouped_kernel(), GroupedExpertWeights), experts.grouped_kernel()
    weights, ids = routing(4, 5)
    groups = group_by_expert(ids, E)
    x = torch.randn(4, H).to(torch.bfloat16)
    with torch.no_grad():
        got = experts(x, weights.to(torch.bfloat16), groups, FUSED_OPS)
        experts.kernel_rows = 0
        want = experts(x, weights.to(torch.bfloat16), groups, FUSED_OPS)
    assert torch.equal(got, want)


def test_spans_outside_the_experts_or_rows_are_refused():
    kernel = make_experts(torch.float32, 40).grouped_kernel()
    rows = torch.randn(3, H)
    for spans in ([(E, 0, 3)], [(0, 0, 4)], [(1, 2, 2)]):
        with pytest.raises(RuntimeError, match="outside"):
            kernel(rows, spans)


def make_clamped(dtype: torch.dtype, inter: int = 24) -> ClampedSwigluExperts:
    torch.manual_seed(1)
    experts = ClampedSwigluExperts(E, H, inter, alpha=1.702, limit=1.5).requires_grad_(False)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.3)
    return experts.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_on_the_grouped_kernel_equal_their_pytorch_products(cpu_isa, dtype):
    """Biases and the clamped SwiGLU (gate and up interleaved; limit 1.5 so that both clamps bite) as kernel options,
    on the checkpoint's [E, H, 2I] weights stored transposed: the same parameters' values, the same outputs."""
    experts = make_clamped(dtype)
    want_experts = make_clamped(dtype)
    kernel = experts.grouped_kernel()
    assert isinstance(kernel, GroupedExpertWeights) and kernel.clamped == (1.702, 1.5), kernel
    assert torch.equal(experts.gate_up_proj, want_experts.gate_up_proj)
    assert experts.gate_up_proj.transpose(1, 2).is_contiguous()
    assert experts.grouped_kernel() is kernel  # found once
    experts.kernel_rows = 1 << 20  # the kernel at any rows per expert, prefill-sized steps too
    for tokens, seed in ((1, 0), (6, 1), (40, 2)):
        weights, ids = routing(tokens, seed)
        groups = group_by_expert(ids, E)
        x = (2 * torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))).to(dtype)
        with torch.no_grad():
            got = experts(x, weights.to(dtype), groups, FUSED_OPS)
            want = want_experts(x, weights.to(dtype), groups)  # the torch ops: one PyTorch product per expert
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,layout,weights_dtype", [
    (torch.float32, "stacked", torch.float32), (torch.bfloat16, "stacked", torch.bfloat16),
    (torch.bfloat16, "stacked", torch.float32), (torch.float32, "linears", torch.float32),
    (torch.bfloat16, "packed", torch.bfloat16)])
def test_the_routed_kernel_gives_run_groupeds_bits_and_counts_each_experts_pairs(cpu_isa, dtype, layout,
                                                                                 weights_dtype):
    """The grouping, the routing weights and the sum over a token's experts in C++ (`moe_experts_routed`): the
    bits of the Python grouping (`group_by_expert` + `run_grouped`) over the same kernel, with the weights in fp32
    (Mixtral) or the hidden dtype (Qwen, OLMoE)."""
    skip_packed_unless_readable(layout)
    experts = with_layout(make_experts(dtype, 40), layout)
    kernel = experts.grouped_kernel()
    assert isinstance(kernel, GroupedExpertWeights), kernel
    counts = torch.zeros(E, dtype=torch.long)
    want_counts = torch.zeros(E, dtype=torch.long)
    for tokens, seed in ((1, 0), (5, 1), (12, 3)):
        weights, ids = routing(tokens, seed)
        weights = weights.to(weights_dtype)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
        groups = group_by_expert(ids, E)
        want_counts += torch.tensor(groups.counts)
        with torch.no_grad():
            got = kernel.routed(x, weights, ids, counts)
            want = run_grouped(x, weights, groups, None, kernel)
        assert got.dtype == dtype and torch.equal(got, want), (tokens, (got.float() - want.float()).abs().max())
    assert torch.equal(counts, want_counts)


LINEAR_ROWS = 32  # csrc/moe_experts.cpp `kLinearRows`: oneDNN's expert products run on a multiple of this many rows


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("on_kernel,passes", [("some", False), ("none", False), ("some", True)])
def test_experts_past_the_limit_run_on_their_own_onednn_weights_from_cpp(monkeypatch, cpu_isa, weights_dtype, on_kernel,
                                                                         passes):
    """Packed bf16 experts in a prefill-sized step whose busiest experts have more pairs than the kernel's limit
    (`run_routed` -> `moe_experts_linears`): those on their own oneDNN weights, the rest on the kernel in one call,
    grouped and combined in C++. The bits of `run_grouped` over the same split with each busy expert's products run
    here on oneDNN (in passes of `pass_rows` rows, each padded with zeros to a multiple of `LINEAR_ROWS`: a row's bits
    depend on the product's row count, not on the other rows), within bf16 rounding of the Python path (unpadded
    products), and the same counts."""
    skip_packed_unless_readable("packed")
    experts = with_layout(make_experts(torch.bfloat16, 40), "packed")
    kernel = experts.grouped_kernel()
    assert isinstance(kernel, GroupedExpertWeights) and kernel.linears is not None
    weights, ids = routing(40, 3)
    weights = weights.to(weights_dtype)
    groups = group_by_expert(ids, E)
    active = sorted(n for n in groups.counts if n)
    experts.kernel_rows = active[1] if on_kernel == "some" else active[0] - 1  # the limit: 2 experts, or none
    assert max(groups.counts) > experts.kernel_rows
    step = 7 if passes else moe.pass_rows(40)
    if passes:  # a busy expert's rows in passes of 7
        monkeypatch.setattr(moe, "pass_rows", lambda inter: step)

    def onednn(rows: torch.Tensor, linear) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, linear.packed, None, "none", [], "")

    def padded_products(e: int, rows: torch.Tensor) -> torch.Tensor:
        mlp, out = experts._modules[str(e)], []
        for start in range(0, rows.shape[0], step):
            chunk = rows[start:start + step]
            chunk = torch.cat([chunk, chunk.new_zeros(-chunk.shape[0] % LINEAR_ROWS, H)])
            out.append(onednn(cpu_kernels.silu_mul(onednn(chunk, mlp.gate_up_proj)), mlp.down_proj))
            out[-1] = out[-1][:min(step, rows.shape[0] - start)]
        return torch.cat(out)

    x = torch.randn(40, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    counts = torch.zeros(E, dtype=torch.long)
    with torch.no_grad():
        got = run_routed(experts, x, weights, ids, counts, FUSED_OPS)
        want = run_grouped(x, weights, groups, padded_products, kernel, experts.kernel_rows)
        python = experts(x, weights, groups, FUSED_OPS)
    assert got is not None and got.dtype == torch.bfloat16
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    torch.testing.assert_close(got.float(), python.float(), **TOL[torch.bfloat16])
    assert counts.tolist() == groups.counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_routed_in_cpp_give_run_groupeds_bits(cpu_isa, dtype):
    experts = make_clamped(dtype)
    kernel = experts.grouped_kernel()
    for tokens, seed in ((1, 0), (6, 1)):
        weights, ids = routing(tokens, seed)
        x = (2 * torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))).to(dtype)
        with torch.no_grad():
            got = kernel.routed(x, weights.to(dtype), ids, None)
            want = run_grouped(x, weights.to(dtype), group_by_expert(ids, E), None, kernel)
        assert torch.equal(got, want)


def test_routed_expert_ids_outside_the_experts_are_refused():
    kernel = make_experts(torch.float32, 40).grouped_kernel()
    for bad in (E, -1):
        with pytest.raises(RuntimeError, match="outside"):
            kernel.routed(torch.randn(1, H), torch.ones(1, 2), torch.tensor([[0, bad]]), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_or_among_many_rows_of_its_expert(cpu_isa, dtype):
    """Plain weights: each row's sums run in one order whatever the rows passed with it (8 or 4 to a pass, then
    fewer), so a token's output does not depend on the batch it decodes in."""
    kernel = make_experts(dtype, 40).grouped_kernel()
    rows = torch.randn(11, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.no_grad():
        together = kernel(rows, [(2, 0, 11)])
        alone = torch.cat([kernel(rows[i:i + 1], [(2, 0, 1)]) for i in range(11)])
    assert torch.equal(together, alone)


def mxfp4_pair(dtype: torch.dtype, inter: int = 64) -> tuple[ClampedSwigluExperts, ClampedSwigluExperts]:
    """gpt-oss experts holding random MXFP4 tensors (some exponents tiny: denormal weights), and the same experts
    with those tensors dequantized (`sage_infer.quantization.mxfp4.dequantize`), the biases shared."""
    from sage_infer.quantization import mxfp4

    gen = torch.Generator().manual_seed(3)
    packed = ClampedSwigluExperts(E, H, inter, alpha=1.702, limit=1.5).requires_grad_(False)
    packed.keep_mxfp4()
    for name in ("gate_up_proj", "down_proj"):
        blocks, scales = getattr(packed, f"{name}_blocks"), getattr(packed, f"{name}_scales")
        blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=gen))
        scales.copy_(torch.randint(120, 130, scales.shape, dtype=torch.uint8, generator=gen))
        scales.view(-1)[::7] = 1
    with torch.no_grad():
        packed.gate_up_proj_bias.normal_(0, 0.3, generator=gen)
        packed.down_proj_bias.normal_(0, 0.3, generator=gen)
    packed = packed.to(dtype)
    plain = ClampedSwigluExperts(E, H, inter, alpha=1.702, limit=1.5).requires_grad_(False).to(dtype)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(plain, name).copy_(mxfp4.dequantize(getattr(packed, f"{name}_blocks"),
                                                        getattr(packed, f"{name}_scales"), dtype))
            getattr(plain, f"{name}_bias").copy_(getattr(packed, f"{name}_bias"))
    return packed, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_give_the_bits_of_their_dequantized_weights(cpu_isa, dtype):
    """The kernel reads MXFP4 codes and exponents in place: each value exact in fp32, the same FMAs in the same order
    as over the dequantized weights, so the same bits at every level, on decode- and prefill-sized steps; the
    per-expert PyTorch path (each expert dequantized as it runs) gives the dequantized experts' products."""
    packed, plain = mxfp4_pair(dtype)
    kernel, want_kernel = packed.grouped_kernel(), plain.grouped_kernel()
    assert isinstance(kernel, GroupedExpertWeights) and kernel.mxfp4_scales is not None, kernel
    wide = cpu_isa != "avx2"
    assert kernel.max_rows() == (None if dtype == torch.float32 else MXFP4_BF16_ROWS if wide else MXFP4_BF16_ROWS_AVX2)
    assert packed.gate_up_proj_blocks.dtype == torch.uint8 and packed.gate_up_proj is None
    for tokens, seed in ((1, 0), (6, 1), (40, 2)):
        weights, ids = routing(tokens, seed)
        groups = group_by_expert(ids, E)
        x = (2 * torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))).to(dtype)
        with torch.no_grad():
            got = run_grouped(x, weights.to(dtype), groups, None, kernel)
            assert torch.equal(got, run_grouped(x, weights.to(dtype), groups, None, want_kernel))
            per_expert = run_grouped(x, weights.to(dtype), groups, packed.expert)
            want = run_grouped(x, weights.to(dtype), groups, plain.expert)
        tol = TOL[dtype] if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-3)  # outputs of up to ~100
        torch.testing.assert_close(per_expert.float(), want.float(), **tol)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_mxfp4_experts_need_widths_in_whole_blocks():
    kernel = mxfp4_pair(torch.float32)[0].grouped_kernel()
    with pytest.raises(RuntimeError, match="multiples of 32"):
        kernel(torch.randn(1, H + 1), [(0, 0, 1)])


@pytest.mark.parametrize("clamped", [False, True])
def test_gates_far_below_zero_give_pytorchs_zeros_not_nans(cpu_isa, clamped):
    """A gate under -52 (gpt-oss: times alpha under -88.7) overflows exp(-gate) in the activation: PyTorch's sigmoid
    and SiLU are then 0; the kernel's must be too (its build assumes finite math), never NaN."""
    experts = make_clamped(torch.float32) if clamped else make_experts(torch.float32, 40)
    experts.kernel_rows = 1 << 20
    weights, ids = routing(3, 5)
    groups = group_by_expert(ids, E)
    x = 400 * torch.randn(3, H, generator=torch.Generator().manual_seed(5))  # gates of hundreds, either sign
    with torch.no_grad():
        got = experts(x, weights, groups, FUSED_OPS)
        want = run_grouped(x, weights, groups, experts.expert)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_rows_dequantized_by_the_kernel_are_the_table_lookups_bits(cpu_isa, dtype):
    """`mxfp4_rows` on the CPU kernel (what a step past the row limit and a load with ``dequantize: true`` use)
    gives each value's bits as PyTorch's table lookups (`mxfp4.expert_rows`) do: -0, denormal exponents and all."""
    from sage_infer.layers.moe_swiglu import mxfp4_rows
    from sage_infer.quantization import mxfp4

    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (48, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (48, 3), dtype=torch.uint8, generator=gen)  # 255 is E8M0's NaN
    got = mxfp4_rows(blocks, scales, dtype)
    want = mxfp4.expert_rows(blocks, scales, dtype)
    assert got.dtype == want.dtype == dtype and got.shape == (48, 96)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_in_one_pass_equals_pytorchs_ops(cpu_isa, dtype):
    """gpt-oss's activation as the per-expert path past the grouped kernel's row limit runs it (`expert_fused`):
    PyTorch's six ops on the strided gate/up halves, to the last bit of a sigmoid (both clamps biting); and a step
    on that path gives the reference's outputs."""
    gen = torch.Generator().manual_seed(5)
    gate_up = (3 * torch.randn(37, 2 * 40, generator=gen)).to(dtype)
    gate = gate_up[:, ::2].clamp(max=1.5)
    up = gate_up[:, 1::2].clamp(min=-1.5, max=1.5)
    want = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    got = cpu_kernels.clamped_swiglu(gate_up, 1.702, 1.5)
    assert got.dtype == dtype and got.shape == want.shape
    ulp = 2e-7 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=1e-6)
    experts = make_clamped(dtype)
    x = torch.randn(3, H, generator=gen).to(dtype)
    with torch.no_grad():
        for e in range(E):
            torch.testing.assert_close(experts.expert_fused(e, x).float(), experts.expert(e, x).float(),
                                       **TOL[dtype])
