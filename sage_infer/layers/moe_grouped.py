"""All active experts of a step in one kernel call (csrc/moe_experts.cpp, `cpu_kernels.moe_experts`): the step's
gate/up products in one parallel region, SiLU(gate) * up (gpt-oss: its clamped SwiGLU, with the experts' biases),
its down products in one more, over the expert weights where they already are (no copy).

`GroupedExpertWeights.of(experts)` finds those weights and their layout, once per set of weights:

- ``packed``: each expert's two `PackedLinear` (bf16) in the oneDNN layout `small_linear` reads (blocks of 64 rows, or
  32 where oneDNN packs for AMX tiles); where the layer did not check that layout itself (`small_rows` 0: no
  AVX512-BF16 kernels in use), one random row per expert through both paths checks it;
- ``plain``: the stacked [E, 2I, H] / [E, H, I] weights (bf16 or fp32), an expert's plain `nn.Linear` pair, or the
  bf16 weight a `PackedLinear` keeps where oneDNN cannot pack bf16.

`GroupedExpertWeights.of_clamped(experts)` does so for gpt-oss's `ClampedSwigluExperts`: their stacked [E, H, 2I] /
[E, I, H] weights are stored transposed once ([E, 2I, H] / [E, H, I] in memory, the same parameters and values), so
each expert's weight is a plain [N, K] matrix, and their biases go with them.

Anything else (quantized experts, separate gate and up, row-tiled linears, fp32 packed by oneDNN in its own
layout, biases on packed linears) gets a reason instead, and the experts keep their per-expert products.

How many rows per expert a step may have (`max_rows`), past which one PyTorch/oneDNN product per expert (a GEMM
that keeps each weight block in registers across many rows) is the faster path; measured with `bench/moe_decode.py
--batches` and `bench/moe_rows.py` on a 2-vCPU Zen 5 (docs/models.md):

- packed bf16: any where the kernels sum bf16 pairs natively (the AVX512-BF16 build), else `GROUPED_KERNEL_ROWS`
  (the kernels in use widen bf16 to fp32 at half the rate of oneDNN's bf16 dot products); in oneDNN's AMX layout
  `PACKED_AMX_ROWS` (its AMX products win past it). Past the limit, each busier expert runs on its own `PackedLinear`
  weights and the others still on the kernel, grouped in C++ (`routed_with_linears`, `cpu_kernels.moe_experts_linears`);
- plain fp32: `PLAIN_FP32_ROWS` (the kernel's plain path is a dot product over 8 rows at a time with 16-lane FMA in
  the AVX-512 builds, 4 rows with 8-lane FMA at AVX2: `PLAIN_FP32_ROWS_AVX2`);
- MXFP4 (gpt-oss's checkpoints kept as they are) in a bf16 model: `MXFP4_BF16_ROWS` (`MXFP4_BF16_ROWS_AVX2`), past
  which each active expert is dequantized (`mxfp4.expert_rows`, the CPU kernel) and multiplied by oneDNN; in an fp32
  model any (PyTorch's fp32 product on the dequantized expert was slower at every row count measured);
- plain bf16 (gpt-oss's experts, transformers' stacked bf16 experts): `PLAIN_BF16_ROWS` (`PLAIN_BF16_ROWS_AVX2`)
  where oneDNN multiplies bf16 (`torch.ops.mkldnn._is_mkldnn_bf16_supported`: AVX-512 and up), since the kernel
  widens each bf16 weight to fp32; any elsewhere (PyTorch's bf16 product without oneDNN was not measured against it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sage_infer.layers import cpu_kernels
from sage_infer.layers.linear import PackedLinear

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
PACKED_ROWS, PACKED_PAIR_STEP = 64, 16  # small_linear's blocks: 64 output rows, column pairs padded to 16
# the most pairs an expert may have in a step the kernel runs where oneDNN's bf16 products are the faster compute
# (bench/moe_decode.py --batches measures both paths; docs/models.md)
GROUPED_KERNEL_ROWS = 16
# packed bf16 in oneDNN's AMX layout (32-row blocks): experts with more pairs than this run on their own oneDNN (AMX)
# products, the rest on the kernel, all grouped in C++ (`routed_with_linears`); the step's time on Qwen3-30B-A3B's
# experts (2-vCPU Xeon with AMX, `bench/moe_decode.py --batches`) at limits 8 / 12 / 16 / 24: 170 / 170 / 185 / 190 ms
# at 128 rows, 181 / 185 / 237 / 312 ms at 256, 212 / 212 / 222 / 236 ms at 512, 307 / 282 / 292 / 302 ms at 1024
PACKED_AMX_ROWS = 12
# plain fp32, per-expert sgemm ÷ kernel: AVX-512 1.2-1.4 at 23-25 pairs an expert, 1.0-1.1 at 41; AVX2 1.7-3.7 at
# up to 13, 0.9-1.4 at 21-25
PLAIN_FP32_ROWS, PLAIN_FP32_ROWS_AVX2 = 32, 16
# plain bf16, oneDNN's bf16 products ÷ kernel: AVX-512 1.1-1.2 at 5-8 pairs, 0.6 at 11-13; AVX2 1.3-2 at up to 3-4,
# 0.8-0.9 at 5-8
PLAIN_BF16_ROWS, PLAIN_BF16_ROWS_AVX2 = 6, 4
# MXFP4 in a bf16 model, the expert dequantized + oneDNN's bf16 product ÷ kernel (gpt-oss-20b's experts): AVX-512
# 1.1-1.3 at 14-20 pairs, 0.8 at 24, 0.5 at 42-46; AVX2 1.4 at 14, 0.9 at 20
MXFP4_BF16_ROWS, MXFP4_BF16_ROWS_AVX2 = 20, 16


@dataclass(slots=True)
class GroupedExpertWeights:
    """The address of each expert's gate/up ([2I, H]) and down ([H, I]) weight, in one layout; `holders` keeps
    the tensors or modules that own the memory alive."""

    packed: int  # packed weights' rows per block (64, or 32 where oneDNN packs for AMX tiles); 0: plain
    dtype: torch.dtype
    intermediate: int
    gate_up: torch.Tensor = field(repr=False)  # [E] int64 addresses
    down: torch.Tensor = field(repr=False)  # [E] int64 addresses
    holders: list = field(repr=False)
    gate_up_bias: torch.Tensor | None = field(default=None, repr=False)  # [E, 2I]
    down_bias: torch.Tensor | None = field(default=None, repr=False)  # [E, H]
    clamped: tuple[float, float] | None = None  # gpt-oss's clamped SwiGLU: (alpha, limit)
    # MXFP4 experts: each expert's exponent bytes ([E] int64 addresses, gate_up's and down's); gate_up and down then
    # address its FP4 codes
    mxfp4_scales: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # packed experts: each expert's oneDNN weights (`PackedLinear.packed` of gate_up, then of down), which
    # multiply the experts past `max_rows` pairs from C++ (`routed_with_linears`)
    linears: tuple[list[torch.Tensor], list[torch.Tensor]] | None = field(default=None, repr=False)
    _options: tuple = field(default=(), repr=False)  # the ops' trailing arguments (`options`), made on first use

    def __call__(self, rows: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """rows [P, H] sorted by expert, the (expert, start, end) spans -> each row's expert output [P, H]."""
        return cpu_kernels.moe_experts(rows, torch.tensor(spans, dtype=torch.long), self.gate_up, self.down,
                                       self.intermediate, self.packed, self.options())

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [T, H], the routing weights and expert ids [T, K] -> [T, H]: the step with its grouping in the kernel
        (`cpu_kernels.moe_experts_routed`); `counts` [E] grows by each expert's pairs."""
        return cpu_kernels.moe_experts_routed(x.contiguous(), weights.contiguous(), ids.contiguous(), counts,
                                              self.gate_up, self.down, self.intermediate, self.packed, self.options())

    def routed_with_linears(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                            limit: int, pass_rows: int) -> torch.Tensor:
        """`routed` where experts past `limit` pairs run on their own oneDNN weights (`linears`; passes of
        `pass_rows` rows) and the others on the kernel, all grouped in C++ (`cpu_kernels.moe_experts_linears`)."""
        return cpu_kernels.moe_experts_linears(x.contiguous(), weights.contiguous(), ids.contiguous(), counts,
                                               self.linears, limit, pass_rows, self.gate_up, self.down,
                                               self.intermediate, self.packed, self.options())

    def block(self, x: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor | None, routing,
              counts: torch.Tensor) -> torch.Tensor:
        """x [T, H], the router's weight [E, H] and bias, and how it routes (`sage_infer.layers.moe.Routing`) ->
        [T, H]: the layer's step in one kernel call (`cpu_kernels.moe_block`); `counts` [E] grows by each expert's
        pairs."""
        return cpu_kernels.moe_block(x.contiguous(), router, router_bias,
                                     (routing.top_k, routing.mode, routing.renormalize, routing.weights_in_dtype),
                                     counts, self.gate_up, self.down, self.intermediate, self.packed, self.options())

    def options(self) -> tuple:
        """The kernel ops' trailing arguments (`cpu_kernels.moe_options`: biases, clamped SwiGLU, MXFP4 exponents),
        made once."""
        if not self._options:
            self._options = cpu_kernels.moe_options(self.dtype, self.gate_up_bias, self.down_bias, self.clamped,
                                                    self.mxfp4_scales)
        return self._options

    def max_rows(self) -> int | None:
        """The most pairs per expert of a step the kernel should take (None: any)."""
        if self.packed == PACKED_ROWS // 2:  # oneDNN's AMX layout: its own products win past this many pairs
            return PACKED_AMX_ROWS
        if self.packed:
            return None if cpu_kernels.moe_experts_native_bf16() else GROUPED_KERNEL_ROWS
        if self.mxfp4_scales is not None:  # past the limit each expert is dequantized, then one bf16 GEMM
            if self.dtype == torch.float32:
                return None
            return MXFP4_BF16_ROWS if cpu_kernels.moe_experts_wide_fma() else MXFP4_BF16_ROWS_AVX2
        wide = cpu_kernels.moe_experts_wide_fma()
        if self.dtype == torch.float32:
            return PLAIN_FP32_ROWS if wide else PLAIN_FP32_ROWS_AVX2
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return PLAIN_BF16_ROWS if wide else PLAIN_BF16_ROWS_AVX2

    @staticmethod
    def of_clamped(experts: nn.Module) -> GroupedExpertWeights | str:
        """The grouped weights of gpt-oss's `ClampedSwigluExperts` (its weights stored transposed on first use),
        or why the kernel cannot run them."""
        why = cpu_kernels.moe_experts_unavailable()
        if why is not None:
            return why
        if experts.is_mxfp4:
            return _mxfp4(experts)
        params = (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias)
        if any(p.device.type != "cpu" or p.dtype not in KERNEL_DTYPES or p.dtype != params[0].dtype for p in params):
            return "the expert weights are not bf16 or fp32 tensors (one dtype) on the CPU"
        with torch.no_grad():
            for param in params[:2]:  # [E, K, N] as the checkpoint has it -> each expert's [N, K] contiguous
                if not param.transpose(1, 2).is_contiguous():
                    param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
        weights = _stacked(experts.gate_up_proj.detach().transpose(1, 2), experts.down_proj.detach().transpose(1, 2),
                           experts.gate_up_proj.shape[2] // 2)
        if isinstance(weights, GroupedExpertWeights):
            weights.gate_up_bias = experts.gate_up_proj_bias.detach().contiguous()
            weights.down_bias = experts.down_proj_bias.detach().contiguous()
            weights.clamped = (float(experts.alpha), float(experts.limit))
        return weights

    @staticmethod
    def of(experts: nn.Module) -> GroupedExpertWeights | str:
        """The grouped weights of a `FusedExperts`, or why the kernel cannot run them."""
        why = cpu_kernels.moe_experts_unavailable()
        if why is not None:
            return why
        inter = experts.intermediate_size
        if experts.gate_up_proj is not None:
            return _stacked(experts.gate_up_proj, experts.down_proj, inter)
        pairs = [(experts._modules[str(e)].gate_up_proj, experts._modules[str(e)].down_proj)
                 for e in range(experts.num_experts)]
        if any(gate_up is None for gate_up, _ in pairs):
            return "gate and up are separate products (quantized experts)"
        if all(type(m) is nn.Linear and m.bias is None for pair in pairs for m in pair):
            return _stacked([g.weight for g, _ in pairs], [d.weight for _, d in pairs], inter)
        if not all(isinstance(m, PackedLinear) and m.bias is None for pair in pairs for m in pair):
            return "the experts' linears are neither packed nor plain (row-tiled or quantized)"
        if all(m.weight_bf16 is not None for pair in pairs for m in pair):  # no bf16 packing on this CPU
            return _stacked([g.weight_bf16 for g, _ in pairs], [d.weight_bf16 for _, d in pairs], inter, pairs)
        return _packed(experts, pairs, inter)


def _stacked(gate_up, down, inter: int, holders: list | None = None) -> GroupedExpertWeights | str:
    """Plain weights: a stacked tensor or a list of per-expert [N, K] tensors."""
    gate_up, down = list(gate_up), list(down)
    if any(w.dtype not in KERNEL_DTYPES or w.dtype != gate_up[0].dtype or w.device.type != "cpu"
           or not w.is_contiguous() for w in gate_up + down):
        return "the expert weights are not contiguous bf16 or fp32 tensors on the CPU"
    return GroupedExpertWeights(0, gate_up[0].dtype, inter, _addresses(gate_up), _addresses(down),
                                [gate_up, down, holders])


def _mxfp4(experts: nn.Module) -> GroupedExpertWeights | str:
    """gpt-oss's MXFP4 experts (`ClampedSwigluExperts.keep_mxfp4`): each expert's codes and exponents in place."""
    tensors = [getattr(experts, f"{name}_{part}") for name in ("gate_up_proj", "down_proj") for part in ("blocks",
                                                                                                        "scales")]
    biases = (experts.gate_up_proj_bias, experts.down_proj_bias)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors + list(biases)):
        return "the MXFP4 experts are not contiguous tensors on the CPU"
    if biases[0].dtype not in KERNEL_DTYPES or biases[1].dtype != biases[0].dtype:
        return "the experts' biases are not bf16 or fp32 (one dtype)"
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = (_addresses(list(t.unbind(0))) for t in tensors)
    return GroupedExpertWeights(0, biases[0].dtype, tensors[2].shape[2] * 32, gate_up_blocks, down_blocks,
                                [tensors], biases[0].detach(), biases[1].detach(),
                                (float(experts.alpha), float(experts.limit)), (gate_up_scales, down_scales))


def _packed(experts: nn.Module, pairs: list, inter: int) -> GroupedExpertWeights | str:
    """Each expert's two `PackedLinear` in small_linear's layout, in blocks of 64 rows or (where oneDNN packs for AMX
    tiles) 32: the layers' own finding where they checked it (`small_rows` > 0), else the first whose sizes fit and
    whose products of one random row per expert agree with the experts' own."""
    hidden = experts.hidden_size
    shapes = [(m, (n, k)) for gate_up, down in pairs for m, (n, k) in ((gate_up, (2 * inter, hidden)),
                                                                       (down, (hidden, inter)))]
    for m, _ in shapes:
        if m.dtype != torch.bfloat16 or m.weight_bf16 is not None:
            return f"the experts are packed by oneDNN as {m.dtype} in a layout of its own"
    found = {m._block_rows for m, _ in shapes if m.small_rows > 0}
    unchecked = [e for e, (g, d) in enumerate(pairs) if g.small_rows == 0 or d.small_rows == 0]
    for rows in sorted(found, reverse=True) if found else (PACKED_ROWS, PACKED_ROWS // 2):
        sizes_fit = all(torch.ops.mkldnn._nbytes(m.packed) == _packed_bytes(n, k, rows) for m, (n, k) in shapes)
        if len(found) > 1 or not sizes_fit:
            continue
        weights = GroupedExpertWeights(rows, torch.bfloat16, inter,
                                       _addresses([torch.ops.mkldnn.data_ptr(g.packed) for g, _ in pairs]),
                                       _addresses([torch.ops.mkldnn.data_ptr(d.packed) for _, d in pairs]), [pairs],
                                       linears=([g.packed for g, _ in pairs], [d.packed for _, d in pairs]))
        if not unchecked or _same_as_each_expert(weights, experts, unchecked):
            return weights
    return "oneDNN packed the experts in another layout than small_linear's"


def _same_as_each_expert(weights: GroupedExpertWeights, experts: nn.Module, ids: list[int]) -> bool:
    """One random row through each expert of `ids` by the kernel and by the expert's own linears."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(len(ids), experts.hidden_size, generator=gen).to(torch.bfloat16)
    got = weights(rows, [(e, i, i + 1) for i, e in enumerate(ids)]).float()
    want = torch.cat([experts._modules[str(e)](rows[i:i + 1]) for i, e in enumerate(ids)]).float()
    return bool(((got - want).abs() <= 0.02 * want.abs().amax(dim=1, keepdim=True) + 1e-3).all())


def _packed_bytes(n: int, k: int, rows: int) -> int:
    pairs = (k + 2 * PACKED_PAIR_STEP - 1) // (2 * PACKED_PAIR_STEP) * PACKED_PAIR_STEP
    return (n + rows - 1) // rows * pairs * rows * 2 * 2


def _addresses(items: list) -> torch.Tensor:
    return torch.tensor([item if isinstance(item, int) else item.data_ptr() for item in items], dtype=torch.long)
