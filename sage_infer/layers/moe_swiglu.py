"""gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed, and experts with biases
that run a clamped SwiGLU, grouped by expert as every MoE layer here is (`sage_infer.layers.moe.group_by_expert`).

An expert, after transformers' ``GptOssExperts``: ``gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]`` with gate
and up interleaved (gate the even columns, up the odd ones); ``g = gate.clamp(max=limit)``,
``u = up.clamp(-limit, limit)``; ``out = ((u + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + down_proj_bias[e]``.

The weights keep the checkpoint's layout and names (``mlp.router.weight`` / ``.bias``, ``mlp.experts.gate_up_proj``
[E, H, 2I], ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]). On a CPU with the
fused elementwise ops (`model.elementwise`) a step's experts run in one call of the grouped-experts kernel
(`sage_infer.layers.moe_grouped`: the biases and the clamped SwiGLU are its options; the weights are stored
transposed on first use, the same values); otherwise, and as the reference, one PyTorch product per active expert on
the stacked weights.

Shapes: T = tokens of the step, H = hidden size, E = experts, K = experts per token, I = an expert's width.
"""

from __future__ import annotations

import torch
from torch import nn

from sage_infer.layers import cpu_kernels
from sage_infer.layers.elementwise import TORCH_OPS, TorchOps
from sage_infer.layers.moe import (
    TOP_K_SOFTMAX,
    ExpertGroups,
    ExpertsInDecodeStep,
    RouterLinear,
    Routing,
    expert_counter,
    moe_step,
    run_experts,
)
from sage_infer.layers.moe_grouped import KERNEL_DTYPES, GroupedExpertWeights
from sage_infer.quantization import mxfp4


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mxfp4.expert_rows` (one expert's MXFP4 blocks [out, G, 16] and scales [out, G] -> its rows [out, G * 32] in
    `dtype`) on the CPU kernel where it runs (`cpu_kernels.mxfp4_rows`, the threads splitting the rows; the same
    bits), else by PyTorch's table lookups."""
    if (blocks.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)
            or cpu_kernels.moe_experts_unavailable() is not None):
        return mxfp4.expert_rows(blocks, scales, dtype)
    out_rows, groups = scales.shape
    out = torch.empty(out_rows, groups * 32, dtype=dtype)
    cpu_kernels.mxfp4_rows(blocks.reshape(out_rows, groups * 16).contiguous(), scales.contiguous(), out)
    return out


class ClampedSwigluExperts(nn.Module):
    """E experts with biases and the clamped SwiGLU, stacked as the checkpoint stores them: float weights, or after
    `keep_mxfp4` the checkpoint's MXFP4 tensors (``gate_up_proj_blocks`` [E, 2I, H / 32, 16] uint8 FP4 codes,
    ``gate_up_proj_scales`` [E, 2I, H / 32] uint8 exponents, ``down_proj_blocks`` / ``down_proj_scales`` likewise
    [E, H, I / 32, ...]), which the grouped kernel reads in place (a quarter of bf16's bytes) and the per-expert
    products dequantize one expert at a time."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.kernel_rows: int | None = None  # as `FusedExperts.kernel_rows`
        self._grouped: tuple[int, GroupedExpertWeights | str] | None = None  # (the weights' address, kernel or why)

    def keep_mxfp4(self) -> None:
        """Before loading (on the meta device): hold the experts' weights as the checkpoint's MXFP4 blocks and
        scales (loaded as they are) in place of the float ``gate_up_proj`` / ``down_proj``."""
        experts, hidden, two_inter = self.gate_up_proj.shape
        for name, rows, cols in (("gate_up_proj", two_inter, hidden), ("down_proj", hidden, two_inter // 2)):
            setattr(self, name, None)
            blocks = torch.empty(experts, rows, cols // 32, 16, dtype=torch.uint8)
            self.register_parameter(f"{name}_blocks", nn.Parameter(blocks, requires_grad=False))
            scales = torch.empty(experts, rows, cols // 32, dtype=torch.uint8)
            self.register_parameter(f"{name}_scales", nn.Parameter(scales, requires_grad=False))

    @property
    def is_mxfp4(self) -> bool:
        return self.gate_up_proj is None

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `e`'s gate_up [H, 2I] and down [I, H] weights (MXFP4 ones dequantized to `dtype`)."""
        if not self.is_mxfp4:
            return self.gate_up_proj[e], self.down_proj[e]
        return tuple(mxfp4_rows(getattr(self, f"{name}_blocks")[e], getattr(self, f"{name}_scales")[e],
                                dtype).t()  # [in, out], a view of [out, in] rows
                     for name in ("gate_up_proj", "down_proj"))

    def expert(self, e: int, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Expert `e` over rows x [N, H] -> [N, H]: PyTorch's ops throughout (the reference), or with `fused` its
        clamped SwiGLU in one C++ pass over the interleaved gate/up (`cpu_kernels.clamped_swiglu`) in place of six
        PyTorch ops on strided halves."""
        gate_up_w, down_w = self.weights(e, x.dtype)
        gate_up = x @ gate_up_w + self.gate_up_proj_bias[e]
        if fused:
            act = cpu_kernels.clamped_swiglu(gate_up, float(self.alpha), float(self.limit))
        else:
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return act @ down_w + self.down_proj_bias[e]

    def expert_fused(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """`expert` with the C++ clamped SwiGLU: what a CPU step past the grouped kernel's row limit runs."""
        return self.expert(e, x, fused=True)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups,
                ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """x [T, H], the routing weights [T, K] and the step's pairs by expert -> [T, H]: each token's experts'
        outputs times their weights, cast to x's dtype, added in expert order (as transformers adds them)."""
        if x.device.type == "cuda":  # the Triton grouped experts (their clamped SwiGLU and biases)
            from sage_infer.layers.triton_moe import cuda_experts  # imports triton: only on a GPU

            if (out := cuda_experts(self, x, weights, groups)) is not None:
                return out
        fused = (ops.name != "torch" and x.device.type == "cpu" and x.dtype in KERNEL_DTYPES
                 and cpu_kernels.moe_experts_unavailable() is None)
        return run_experts(self, x, weights, groups, ops, self.expert_fused if fused else self.expert)

    def grouped_kernel(self) -> GroupedExpertWeights | str:
        """The experts as the grouped kernel reads them, or why it cannot (found again if the weights change)."""
        first = self.gate_up_proj_blocks if self.is_mxfp4 else self.gate_up_proj
        if self._grouped is None or self._grouped[0] != first.data_ptr():
            kernel = GroupedExpertWeights.of_clamped(self)  # may store the weights anew
            self._grouped = (first.data_ptr(), kernel)
        return self._grouped[1]


class TopKSoftmaxMoeBlock(ExpertsInDecodeStep, nn.Module):
    """gpt-oss's MLP: ``router`` (a linear with a bias, [E, H]) picks each token's top-k experts by logit, their
    weights the softmax over those k logits; the ``experts`` are `ClampedSwigluExperts`.

    `expert_tokens` counts the (token, expert) pairs routed to each expert since start (``sage:moe_expert_tokens``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, alpha: float,
                 limit: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.routing = Routing(top_k, TOP_K_SOFTMAX)
        self.router = RouterLinear(hidden_size, num_experts, bias=True)
        self.experts = ClampedSwigluExperts(num_experts, hidden_size, intermediate_size, alpha, limit)
        self.expert_counts = expert_counter(num_experts)

    @property
    def expert_tokens(self) -> list[int]:
        return self.expert_counts.tolist()

    @property
    def router_linear(self) -> nn.Module:
        return self.router

    def fuse_projections(self) -> int:
        """Nothing to stack: the experts stay on their stacked weights (the packed expert linears run plain SwiGLU)."""
        return 0

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """x [T, H] (the layer's normed input) -> [T, H]; `ops` decides whether the grouped kernel runs."""
        return moe_step(self.router, self.experts, x, self.routing, self.expert_counts, ops)
