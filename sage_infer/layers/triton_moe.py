"""A mixture-of-experts layer's experts on CUDA in Triton: every active expert of a step in two launches, whatever
the batch, instead of one product per expert (`sage_infer.layers.moe.run_grouped`, which stays the oracle).

The step's (token, expert) pairs, already sorted by expert (`moe.group_by_expert`), are laid out in blocks of
`block_rows` pairs, each expert's pairs starting on a block of their own and its last block padded
(`align_blocks`: the idea of vLLM's ``moe_align_block_size``, here built from the sorted order with tensor ops).
Each program of a launch takes one block (one expert) and one tile of output columns:

- gate/up: the block's token rows of x (read in place by token, no gathered copy) times the expert's gate and up
  rows, both accumulated in fp32, the activation fused (SiLU(gate) * up; or gpt-oss's clamped SwiGLU with its biases)
  and written, in x's dtype, at the pair's row of an intermediate [P, I];
- down: those rows times the expert's down weight (plus its bias), rounded to x's dtype, times the pair's routing
  weight, written at the pair's row of [P, H].

A token's K weighted rows are then added one by one in expert order, as `run_grouped` adds them (the same order
whatever else the batch holds). Numerics: products accumulated in fp32 (IEEE fp32 for an fp32 model, no TF32);
gate and up rounded to x's dtype before the activation and the expert's output before its weight, where the
PyTorch path rounds them, so a bf16 step is within bf16 rounding of the oracle and an fp32 one within fp32's.

Two weight layouts: `swiglu_experts` takes the stacked ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``down_proj`` [E, H, I] of `moe.FusedExperts`; `clamped_swiglu_experts` gpt-oss's ``gate_up_proj`` [E, H, 2I]
(gate and up interleaved column by column) and ``down_proj`` [E, I, H] with their biases
(`moe_swiglu.ClampedSwigluExperts`). Without a GPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported) on CPU tensors: for the tests only.

Shapes: T tokens, H hidden size, E experts, K experts per token, I an expert's width, P = T * K pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch
from torch import nn

from sage_infer.layers.triton_paged import interpreting, triton, triton_unavailable

if TYPE_CHECKING:
    from sage_infer.layers.moe import ExpertGroups

try:
    import triton.language as tl
except ImportError:  # optional, as in triton_paged
    tl = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COLUMNS, DEPTH = 64, 64  # output columns per program, and the reduction's tile


def _gate_up(
    x_ptr, w_ptr, bias_ptr, slots_ptr, experts_ptr, tokens_ptr, out_ptr, pairs, hidden, inter, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_ot, up_offset, gate_step,
    ROWS: tl.constexpr, COLS: tl.constexpr, DEPTH_TILE: tl.constexpr, CLAMPED: tl.constexpr, BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, WIDEN: tl.constexpr,
):
    """One (block of an expert's pairs, tile of COLS of its I columns): act(x·gateᵀ, x·upᵀ) into the pairs' rows.
    Gate column n is weight row n * gate_step, up column n row n * gate_step + up_offset."""
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block).to(tl.int64)
    r = tl.arange(0, ROWS)
    slot = tl.load(slots_ptr + block * ROWS + r)
    row_ok = slot < pairs
    token = tl.load(tokens_ptr + slot, mask=row_ok, other=0).to(tl.int64)
    n = tl.program_id(1) * COLS + tl.arange(0, COLS)
    col_ok = n < inter
    gate_rows = expert * stride_we + (n * gate_step).to(tl.int64) * stride_wn
    up_rows = expert * stride_we + (n * gate_step + up_offset).to(tl.int64) * stride_wn
    gate = tl.zeros([ROWS, COLS], dtype=tl.float32)
    up = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for k0 in range(0, hidden, DEPTH_TILE):
        k = k0 + tl.arange(0, DEPTH_TILE)
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_ptr + gate_rows[None, :] + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(w_ptr + up_rows[None, :] + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if FP32_DOT or WIDEN:  # fp32 model: IEEE; the interpreter's 16-bit dot is wrong: the exact products in fp32
            a32 = a.to(tl.float32)
            gate += tl.dot(a32, wg.to(tl.float32), input_precision="ieee")
            up += tl.dot(a32, wu.to(tl.float32), input_precision="ieee")
        else:
            gate += tl.dot(a, wg)
            up += tl.dot(a, wu)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)  # the PyTorch path's products are in x's dtype
    up = up.to(dtype).to(tl.float32)
    if BIAS:
        bias = bias_ptr + expert * stride_be
        gate = (gate + tl.load(bias + n * gate_step, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        up = (up + tl.load(bias + n * gate_step + up_offset, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
    if CLAMPED:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate clamped from above
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + slot.to(tl.int64)[:, None] * stride_ot + n[None, :], act.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


def _down(
    a_ptr, w_ptr, bias_ptr, slots_ptr, experts_ptr, weights_ptr, out_ptr, pairs, inter, hidden,
    stride_at, stride_we, stride_wn, stride_wk, stride_be, stride_ot,
    ROWS: tl.constexpr, COLS: tl.constexpr, DEPTH_TILE: tl.constexpr, BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, WIDEN: tl.constexpr,
):
    """One (block of an expert's pairs, tile of COLS of the H columns): the pairs' activations times the expert's
    down weight (plus its bias), rounded to the output dtype, times each pair's routing weight."""
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block).to(tl.int64)
    r = tl.arange(0, ROWS)
    slot = tl.load(slots_ptr + block * ROWS + r)
    row_ok = slot < pairs
    rows = slot.to(tl.int64)
    n = tl.program_id(1) * COLS + tl.arange(0, COLS)
    col_ok = n < hidden
    w_rows = expert * stride_we + n.to(tl.int64) * stride_wn
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for k0 in range(0, inter, DEPTH_TILE):
        k = k0 + tl.arange(0, DEPTH_TILE)
        k_ok = k < inter
        a = tl.load(a_ptr + rows[:, None] * stride_at + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + w_rows[None, :] + k[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if FP32_DOT or WIDEN:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dtype = out_ptr.dtype.element_ty
    acc = acc.to(dtype).to(tl.float32)
    if BIAS:
        acc = (acc + tl.load(bias_ptr + expert * stride_be + n, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(
            dtype).to(tl.float32)
    weight = tl.load(weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], (acc * weight[:, None]).to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@cache
def _kernels():
    """Both kernels compiled for the GPU, or wrapped for the interpreter under ``TRITON_INTERPRET=1``. The step's
    count of (token, expert) pairs is not specialized on (Triton compiles anew for an integer that turns 1 or a
    multiple of 16: steps of new sizes would wait for compiles while serving)."""
    return triton.jit(_gate_up, do_not_specialize=["pairs"]), triton.jit(_down, do_not_specialize=["pairs"])


def experts_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton experts run on `device` in `dtype`, else why not."""
    if (why := triton_unavailable(device)) is not None:
        return why
    if dtype not in KERNEL_DTYPES:
        return f"the Triton experts take bf16, fp16 or fp32 weights, not {dtype}"
    return None


def _check_runnable(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the Triton experts are unavailable: triton is not installed")
    if x.device.type == "cpu" and not interpreting():
        raise RuntimeError("the Triton experts take CPU tensors only under TRITON_INTERPRET=1")


def block_rows(pairs: int, active_experts: int) -> int:
    """Pairs per block: 16 (tl.dot's least) for a step of a few pairs per expert (decode), 64 for prefill."""
    return 64 if pairs >= 64 * active_experts else 16


def align_blocks(counts: list[int], rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [E]: pairs per expert of a step sorted by expert -> (slots [N * rows] int32: each block's sorted pair
    index per row, P for padding; experts [N] int32: each block's expert), every expert's pairs from a block of
    their own. Tensor ops from the counts (the host already has them: `ExpertGroups.counts`)."""
    pairs, n_blocks = sum(counts), sum(-(-c // rows) for c in counts)
    count = torch.tensor(counts, dtype=torch.long, device=device)
    blocks = (count + rows - 1) // rows
    padded_start = (torch.cumsum(blocks, 0) - blocks) * rows
    start = torch.cumsum(count, 0) - count
    shift = torch.repeat_interleave(padded_start - start, count, output_size=pairs)
    slots = torch.full((n_blocks * rows,), pairs, dtype=torch.int32, device=device)
    index = torch.arange(pairs, device=device)
    slots[index + shift] = index.to(torch.int32)
    experts = torch.repeat_interleave(torch.arange(len(counts), device=device, dtype=torch.int32), blocks,
                                      output_size=n_blocks)
    return slots, experts


@dataclass(frozen=True)
class _Weights:
    """An expert weight as the kernels address it: element (e, output column n, reduction index k) at
    ``e * stride_e + n * stride_n + k * stride_k``; `bias` [E, columns] or None."""

    tensor: torch.Tensor
    stride_e: int
    stride_n: int
    stride_k: int
    bias: torch.Tensor | None = None


def _run(x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups, gate_up: _Weights, down: _Weights,
         inter: int, up_offset: int, gate_step: int, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """Both launches over the step's blocks, then each token's K weighted rows added in expert order."""
    _check_runnable(x)
    gate_up_kernel, down_kernel = _kernels()
    tokens, hidden = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    pairs = len(groups.order)
    rows = block_rows(pairs, len(groups.spans))
    slots, experts = align_blocks(groups.counts, rows, x.device)
    n_blocks = experts.shape[0]
    flags = dict(FP32_DOT=x.dtype == torch.float32, WIDEN=interpreting() and x.dtype != torch.float32)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    alpha, limit = clamp or (1.0, 0.0)
    gate_up_kernel[(n_blocks, triton.cdiv(inter, COLUMNS))](
        x, gate_up.tensor, x if gate_up.bias is None else gate_up.bias, slots, experts, groups.tokens, act, pairs,
        hidden, inter, alpha, limit, x.stride(0), gate_up.stride_e, gate_up.stride_n, gate_up.stride_k,
        0 if gate_up.bias is None else gate_up.bias.stride(0), act.stride(0), up_offset, gate_step,
        ROWS=rows, COLS=COLUMNS, DEPTH_TILE=DEPTH, CLAMPED=clamp is not None, BIAS=gate_up.bias is not None, **flags)
    pair_weights = weights.reshape(-1)[groups.order].contiguous()
    scaled = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    down_kernel[(n_blocks, triton.cdiv(hidden, COLUMNS))](
        act, down.tensor, x if down.bias is None else down.bias, slots, experts, pair_weights, scaled, pairs, inter,
        hidden, act.stride(0), down.stride_e, down.stride_n, down.stride_k,
        0 if down.bias is None else down.bias.stride(0), scaled.stride(0),
        ROWS=rows, COLS=COLUMNS, DEPTH_TILE=DEPTH, BIAS=down.bias is not None, **flags)
    per_token = scaled[groups.by_token].view(tokens, weights.shape[1], hidden)
    total = per_token[:, 0].clone()
    for k in range(1, weights.shape[1]):  # K adds in expert order, as run_grouped adds them
        total += per_token[:, k]
    return total


def swiglu_experts(x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> torch.Tensor:
    """`moe.FusedExperts`'s experts: x [T, H], the routing weights [T, K] and the step's pairs by expert, gate_up_proj
    [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I], all in x's dtype -> [T, H]."""
    inter = down_proj.shape[2]
    gate_up = _Weights(gate_up_proj, gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2))
    down = _Weights(down_proj, down_proj.stride(0), down_proj.stride(1), down_proj.stride(2))
    return _run(x, weights, groups, gate_up, down, inter, up_offset=inter, gate_step=1)


def clamped_swiglu_experts(x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups, gate_up_proj: torch.Tensor,
                           gate_up_bias: torch.Tensor, down_proj: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                           limit: float) -> torch.Tensor:
    """gpt-oss's experts (`moe_swiglu.ClampedSwigluExperts`): gate_up_proj [E, H, 2I] (gate the even columns, up the
    odd ones), gate_up_bias [E, 2I], down_proj [E, I, H], down_bias [E, H], all in x's dtype -> [T, H]."""
    inter = down_proj.shape[1]
    gate_up = _Weights(gate_up_proj, gate_up_proj.stride(0), gate_up_proj.stride(2), gate_up_proj.stride(1),
                       gate_up_bias)
    down = _Weights(down_proj, down_proj.stride(0), down_proj.stride(2), down_proj.stride(1), down_bias)
    return _run(x, weights, groups, gate_up, down, inter, up_offset=1, gate_step=2, clamp=(alpha, limit))


@cache
def _unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    return experts_unavailable(device, dtype)


def cuda_experts(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor,
                 groups: ExpertGroups) -> torch.Tensor | None:
    """A MoE layer's step on a CUDA device by the Triton kernels (`triton_experts`), or None where they cannot run
    it (no triton, an older GPU, weights not stacked in x's dtype): the layer's per-expert loop then does."""
    if not groups.spans or _unavailable(x.device, x.dtype) is not None:
        return None
    return triton_experts(experts, x, weights, groups)


def triton_experts(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor,
                   groups: ExpertGroups) -> torch.Tensor | None:
    """`moe.FusedExperts` (stacked weights) or `moe_swiglu.ClampedSwigluExperts` over a step: x [T, H], the routing
    weights [T, K], the step's pairs by expert -> [T, H]; None for weights the kernels do not take (experts split
    into linears, quantized, or in another dtype than x)."""
    from sage_infer.layers.moe_swiglu import ClampedSwigluExperts

    if isinstance(experts, ClampedSwigluExperts):
        params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
        if any(p.dtype != x.dtype for p in params):
            return None
        return clamped_swiglu_experts(x, weights, groups, *(p.detach() for p in params), experts.alpha,
                                      experts.limit)
    if getattr(experts, "gate_up_proj", None) is None or experts.gate_up_proj.dtype != x.dtype:
        return None
    return swiglu_experts(x, weights, groups, experts.gate_up_proj.detach(), experts.down_proj.detach())
