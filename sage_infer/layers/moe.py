"""Mixture-of-experts layers: a router that picks each token's top-k experts, and the experts of a step run
grouped, so each expert's weights are read once per step whatever the batch.

Shapes: T = tokens of the step, H = hidden size, E = experts, K = experts per token (top-k), I = an expert's
intermediate size. An expert is a gated MLP ``down(silu(gate(x)) * up(x))`` with gate and up stacked into one
weight: `FusedExperts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], the layout (and the names) of
transformers' own MoE modules and of vLLM's fused MoE.

A step's (token, expert) pairs are sorted by expert (`group_by_expert`); each expert with tokens runs one
product over its rows; the rows, scaled by their routing weights, are summed back into their tokens in expert
order (what transformers computes, pair for pair). This is the reference and the oracle: a faster path is
checked against it.

On a CPU, with the fused elementwise ops (`model.elementwise`), a step runs all its experts in one kernel call
instead (`sage_infer.layers.moe_grouped`, csrc/moe_experts.cpp: every gate/up product in one parallel region, every
down product in one more, rather than two regions per expert; an expert's many rows of a prefill chunk multiplied as
one small GEMM), up to the pairs per expert the weights' layout allows (`GroupedExpertWeights.max_rows`: packed bf16
experts at the levels without bf16 dot products only steps of at most `GROUPED_KERNEL_ROWS`, decode steps; an expert
with more runs its own products and the others still share one call, `run_experts`, all in one C++ call for oneDNN's
packed bf16 experts, `run_routed`), with the grouping, the routing weights and the sum over a token's experts done in
the same call to `run_grouped`'s bits; a decode-sized step (`ROUTE_KERNEL_ROWS`) has its router's product and top-k
in that call too (`moe_step`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sage_infer.layers import cpu_kernels
from sage_infer.layers.elementwise import TORCH_OPS, TorchOps, pass_rows
from sage_infer.layers.linear import PackedLinear
from sage_infer.layers.moe_grouped import GROUPED_KERNEL_ROWS, KERNEL_DTYPES, GroupedExpertWeights

__all__ = ["GROUPED_KERNEL_ROWS", "SOFTMAX_TOP_K", "TOP_K_SOFTMAX", "ExpertGroups", "FusedExperts", "RouterLinear",
           "Routing", "SparseMoeBlock", "count_groups", "expert_counter", "group_by_expert", "moe_step", "route",
           "route_tokens", "routes_in_kernel", "run_block", "run_experts", "run_grouped", "run_routed"]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] float32, expert ids [T, K]): the softmax over all experts in float32,
    its top-k, divided by their sum when `renormalize` (``norm_topk_prob``; Mixtral's top-k then softmax is the
    same numbers)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


SOFTMAX_TOP_K, TOP_K_SOFTMAX = 0, 1  # how a router's logits pick experts (csrc/moe_experts.cpp's route modes)


@dataclass(frozen=True, slots=True)
class Routing:
    """How a layer's router logits become each token's experts and weights: SOFTMAX_TOP_K (the softmax over every
    expert in fp32, its top k, divided by their sum where `renormalize`: `route`) or TOP_K_SOFTMAX (gpt-oss: the top
    k logits softmaxed among themselves in their dtype); `weights_in_dtype`: the weights rounded to the hidden dtype
    before they scale the experts' outputs (transformers' Qwen, OLMoE and gpt-oss; Mixtral keeps fp32)."""

    top_k: int
    mode: int = SOFTMAX_TOP_K
    renormalize: bool = False
    weights_in_dtype: bool = True


class RouterLinear(nn.Linear):
    """A mixture-of-experts router, [E, H] (with a bias where the model has one). `pack_linears` gives it a packed
    copy to multiply by (`use_packed`) and leaves its plain weight, which the C++ routing reads: on a CPU with the
    fused ops (`model.elementwise`) a step of up to `ROUTE_KERNEL_ROWS` rows has its router product, softmax and
    top-k in one C++ call (`cpu_kernels.moe_route`, or `moe_block` with the experts)."""

    keep_plain = True
    packed_linear: nn.Module | None = None  # not a submodule: the packed copy is this layer, not a layer of its own

    def use_packed(self, packed: nn.Module) -> None:
        object.__setattr__(self, "packed_linear", packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed_linear(x) if self.packed_linear is not None else super().forward(x)


# a step of up to this many rows is routed in C++, larger ones by the packed product and PyTorch's softmax and top-k,
# which oneDNN's GEMM makes faster there (Qwen3-30B-A3B's router, 2-vCPU Zen 4, PyTorch ÷ C++: bf16 1.3-2.6 at 1-4
# rows, 0.7-1.2 at 8, 0.4-0.9 at 12-16; fp32 1.5-2.9 at 1-4, 0.8-1.3 at 8; AVX2 and AVX512-BF16 kernels)
ROUTE_KERNEL_ROWS = 8


def routes_in_kernel(router: nn.Module, x: torch.Tensor, ops: TorchOps) -> bool:
    """Whether `router`'s routing of x runs in C++ (`route_tokens`)."""
    return (isinstance(router, RouterLinear) and x.shape[0] <= ROUTE_KERNEL_ROWS and ops.name != "torch"
            and x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and router.weight.dtype == x.dtype
            and cpu_kernels.moe_experts_unavailable() is None)


def route_tokens(router: nn.Module, x: torch.Tensor, routing: Routing, ops: TorchOps) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """x [T, H] -> (weights [T, K], expert ids [T, K]) as `routing` says: in C++ where `routes_in_kernel`, else
    from the router's logits by PyTorch ops (the reference; of equal weights the two may pick different experts,
    and their softmaxes can differ in the last bits)."""
    if routes_in_kernel(router, x, ops):
        return cpu_kernels.moe_route(x.contiguous(), router.weight, router.bias, routing.top_k, routing.mode,
                                     routing.renormalize, routing.weights_in_dtype)
    logits = router(x)
    if routing.mode == TOP_K_SOFTMAX:
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), ids
    weights, ids = route(logits, routing.top_k, routing.renormalize)
    return (weights.to(x.dtype) if routing.weights_in_dtype else weights), ids


@dataclass(slots=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: pair ``i`` of the sorted order is flattened pair
    ``order[i]`` (token ``order[i] // K``); expert ``e``'s rows are ``spans`` entry ``(e, start, end)``."""

    order: torch.Tensor  # [T*K] long: flattened (token, slot) pairs in expert order
    tokens: torch.Tensor  # [T*K] long: the token of each sorted pair
    by_token: torch.Tensor  # [T*K] long: the sorted pairs token by token, each token's in expert order
    counts: list[int]  # [E] pairs routed to each expert this step
    spans: list[tuple[int, int, int]]  # (expert, start, end) of each expert with at least one pair


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """ids [T, K] -> the pairs sorted by expert (stable: within an expert, in token order)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the step's one host sync: the spans' sizes
    spans, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            spans.append((expert, start, start + n))
            start += n
    tokens = order // ids.shape[1]
    return ExpertGroups(order, tokens, torch.argsort(tokens * num_experts + flat[order]), counts, spans)


def run_grouped(x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups,
                expert: Callable[[int, torch.Tensor], torch.Tensor] | None,
                all_experts: Callable[[torch.Tensor, list], torch.Tensor] | None = None,
                all_rows: int | None = None) -> torch.Tensor:
    """x [T, H], the routing weights [T, K] and the step's pairs by expert -> [T, H]: `expert(e, rows)` once per
    expert with tokens (its weights read once), or `all_experts(rows, spans)` once for all of them (with `all_rows`:
    for those with at most that many pairs, `expert` for the others); each output times its weight (in the weights'
    dtype, then x's), a token's K outputs added one by one in expert order (as transformers adds them)."""
    rows = x.index_select(0, groups.tokens)
    if all_experts is not None and all_rows is None:
        out = all_experts(rows, groups.spans)
    else:
        out = torch.empty_like(rows)
        fewer, alone = [], []
        for span in groups.spans:
            (fewer if all_experts is not None and span[2] - span[1] <= all_rows else alone).append(span)
        if fewer:  # their rows gathered into one call, spans renumbered
            index = torch.cat([torch.arange(start, end) for _, start, end in fewer])
            starts = [0, *itertools.accumulate(end - start for _, start, end in fewer)]
            out[index] = all_experts(rows[index], [(e, starts[i], starts[i + 1]) for i, (e, _, _) in enumerate(fewer)])
        for e, start, end in alone:
            out[start:end] = expert(e, rows[start:end])
    scaled = (out * weights.reshape(-1)[groups.order].unsqueeze(1)).to(x.dtype)
    per_token = scaled[groups.by_token].view(x.shape[0], weights.shape[1], x.shape[1])
    total = per_token[:, 0].clone()
    for k in range(1, weights.shape[1]):  # K adds, not a reduction whose order could change with T
        total += per_token[:, k]
    return total


class ExpertMLP(nn.Module):
    """One expert as its own linears: ``down_proj(silu(gate) * up)``, gate and up one ``gate_up_proj`` or, as a
    checkpoint stores them (quantized ones stay so), ``gate_proj`` and ``up_proj``."""

    def __init__(self, down_proj: nn.Module, gate_up_proj: nn.Module | None = None, gate_proj: nn.Module | None = None,
                 up_proj: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_up_proj, self.gate_proj, self.up_proj, self.down_proj = gate_up_proj, gate_proj, up_proj, down_proj

    def fuse_projections(self) -> int:
        """Stack plain `nn.Linear` gate and up into one ``gate_up_proj`` (1), else leave them (0)."""
        if type(self.gate_proj) is not nn.Linear or type(self.up_proj) is not nn.Linear:
            return 0
        self.gate_up_proj = _linear(torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()]))
        self.gate_proj = self.up_proj = None
        return 1

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return ops.gated_mlp(self.gate_up_proj, self.down_proj, x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedExperts(nn.Module):
    """E gated-MLP experts, gate and up stacked: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I].

    `split_linears` turns them into one `ExpertMLP` per expert (children ``0`` .. ``E-1``, gate and up one
    linear), which the engine then packs for the CPU kernels like every other linear (`model.linear`);
    `separate_linears` does so before loading, with gate, up and down as a checkpoint names them
    (``experts.<e>.gate_proj``), for a checkpoint that stores its experts quantized. The grouped product is the
    same whichever holds the weights."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                                          hidden_size))
        self.down_proj: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # steps whose experts have at most this many pairs each run on the grouped kernel (0: never; None: as
        # many as the weights' layout allows, `GroupedExpertWeights.max_rows`)
        self.kernel_rows: int | None = None
        self._grouped: tuple[object, GroupedExpertWeights | str] | None = None  # (the weights, kernel or why not)

    def split_linears(self) -> int:
        """One `ExpertMLP` per expert in place of the stacked weights (each weight a view of them: nothing is
        copied); experts already apart get gate and up stacked. How many experts got a stacked gate/up."""
        if self.gate_up_proj is None:
            return sum(self.get_submodule(str(e)).fuse_projections() for e in range(self.num_experts))
        for e in range(self.num_experts):
            self.add_module(str(e), ExpertMLP(_linear(self.down_proj[e].detach()),
                                              gate_up_proj=_linear(self.gate_up_proj[e].detach())))
        self.gate_up_proj = self.down_proj = None
        return self.num_experts

    def separate_linears(self) -> None:
        """Before loading (on the meta device): one `ExpertMLP` of three `nn.Linear` per expert, named as a
        checkpoint names them, so that quantized ones load as any quantized linear does."""
        h, i = self.hidden_size, self.intermediate_size
        for e in range(self.num_experts):
            self.add_module(str(e), ExpertMLP(nn.Linear(i, h, bias=False), gate_proj=nn.Linear(h, i, bias=False),
                                              up_proj=nn.Linear(h, i, bias=False)))
        self.gate_up_proj = self.down_proj = None

    def expert(self, e: int, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """Expert `e` over rows x [N, H] -> [N, H]."""
        if self.gate_up_proj is None:
            return self._modules[str(e)](x, ops)
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups,
                ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """x [T, H], the routing weights [T, K] and the step's pairs by expert -> [T, H]: each token's experts'
        outputs times their weights (in the weights' dtype, then x's), added one by one in expert order (as
        transformers adds them; the same bits whatever else the batch holds)."""
        if x.device.type == "cuda":  # the Triton grouped experts, where they take the weights
            from sage_infer.layers.triton_moe import cuda_experts  # imports triton: only on a GPU

            if (out := cuda_experts(self, x, weights, groups)) is not None:
                return out
        return run_experts(self, x, weights, groups, ops, lambda e, rows: self.expert(e, rows, ops))

    def grouped_kernel(self) -> GroupedExpertWeights | str:
        """The experts' weights as the grouped kernel reads them, or why it cannot: found on first use and again
        after the weights are replaced (packing, tiling)."""
        first = self.gate_up_proj if self.gate_up_proj is not None else self._modules["0"].gate_up_proj
        if self._grouped is None or self._grouped[0] is not first:
            self._grouped = (first, GroupedExpertWeights.of(self))
        return self._grouped[1]

    def keeps_stack(self) -> bool:
        """fp32 stacked experts stay stacked when the grouped kernel can run them: oneDNN packs fp32 in a layout
        only it reads, and a copy in each layout would double the experts' memory. bf16 ones are split and packed:
        the kernel reads oneDNN's bf16 layouts (blocks of 64 rows, or 32 for AMX tiles), and oneDNN's products of
        many rows per expert run faster on packed weights than on plain ones (docs/models.md)."""
        return (self.gate_up_proj is not None and self.gate_up_proj.dtype == torch.float32
                and isinstance(GroupedExpertWeights.of(self), GroupedExpertWeights))


def run_experts(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups, ops: TorchOps,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`run_grouped` of `experts` (with `kernel_rows` and `grouped_kernel()`) over the step: every expert in one
    grouped kernel call where the kernel takes them all; where some have more pairs than its limit, those one
    product each (`expert(e, rows)`) and the rest still in one call; else one product each."""
    limit = _kernel_limit(experts, x, ops) if groups.spans else False
    if limit is False:
        return run_grouped(x, weights, groups, expert)
    if limit is None or max(groups.counts) <= limit:
        return run_grouped(x, weights, groups, None, experts.grouped_kernel())
    return run_grouped(x, weights, groups, expert, experts.grouped_kernel(), limit)


def run_routed(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               counts: torch.Tensor, ops: TorchOps) -> torch.Tensor | None:
    """The step with its grouping done in C++, without `run_experts`' Python ops: on the grouped kernel where it takes
    a step of x's rows whatever their routing (no expert can get more pairs than there are rows:
    `GroupedExpertWeights.routed`, `run_experts`' bits), or, for oneDNN's packed experts, the experts past the
    kernel's limit on their own oneDNN products (on row counts rounded up to 32: within rounding of `run_experts`)
    and the rest on the kernel (`routed_with_linears`); `counts` [E] grows by each expert's pairs. None: neither, and
    the caller groups the pairs itself."""
    limit = _kernel_limit(experts, x, ops)
    if limit is False:
        return None
    kernel = experts.grouped_kernel()
    if limit is None or x.shape[0] <= limit:
        return kernel.routed(x, weights, ids, counts)
    if kernel.linears is None:
        return None
    return kernel.routed_with_linears(x, weights, ids, counts, limit, pass_rows(kernel.intermediate))


def run_block(router: nn.Module, experts: nn.Module, x: torch.Tensor, routing: Routing, counts: torch.Tensor,
              ops: TorchOps) -> torch.Tensor | None:
    """The whole step in one kernel call (`GroupedExpertWeights.block`: the router's product and top-k, the grouping,
    the experts), where the router routes in C++ (`routes_in_kernel`) and the grouped kernel takes the step whatever
    its routing; None otherwise."""
    if not routes_in_kernel(router, x, ops) or not _kernel_takes(experts, x, ops):
        return None
    return experts.grouped_kernel().block(x, router.weight, router.bias, routing, counts)


def moe_step(router: nn.Module, experts: nn.Module, x: torch.Tensor, routing: Routing, counts: torch.Tensor,
             ops: TorchOps) -> torch.Tensor:
    """x [T, H] -> [T, H]: the experts' outputs of each token, weighted and summed, in one kernel call where it can
    run (`run_block`), else routed (`route_tokens`) and then grouped in C++ (`run_routed`) or here; `counts` grows
    by each expert's pairs."""
    out = run_block(router, experts, x, routing, counts, ops)
    if out is not None:
        return out
    weights, ids = route_tokens(router, x, routing, ops)
    out = run_routed(experts, x, weights, ids, counts, ops)
    return out if out is not None else experts(x, weights, count_groups(counts, ids), ops)


def _kernel_takes(experts: nn.Module, x: torch.Tensor, ops: TorchOps) -> bool:
    """Whether the grouped kernel runs a step of x's rows whatever their routing."""
    limit = _kernel_limit(experts, x, ops)
    return limit is not False and (limit is None or x.shape[0] <= limit)


def _kernel_limit(experts: nn.Module, x: torch.Tensor, ops: TorchOps) -> int | None | bool:
    """The most pairs per expert a step of `experts` may have on the grouped kernel (None: any), False where the
    kernel does not run them at all."""
    if ops.name == "torch" or x.device.type != "cpu" or experts.kernel_rows == 0:
        return False
    kernel = experts.grouped_kernel()
    if not isinstance(kernel, GroupedExpertWeights) or kernel.dtype != x.dtype:
        return False
    return _pairs_limit(experts, kernel)


def _pairs_limit(experts: nn.Module, kernel: GroupedExpertWeights) -> int | None:
    """The most pairs an expert of `experts` may have in a step on `kernel` (None: any): their `kernel_rows` where
    set, else the weights' layout's own (`max_rows`)."""
    return experts.kernel_rows if experts.kernel_rows is not None else kernel.max_rows()


def expert_counter(num_experts: int) -> torch.Tensor:
    """The pairs routed to each expert since start: [E] int64 on the CPU (the grouped kernel adds to it in place),
    whatever device the model is built on."""
    return torch.zeros(num_experts, dtype=torch.long, device="cpu")


def count_groups(counts: torch.Tensor, ids: torch.Tensor) -> ExpertGroups:
    """The step's pairs by expert (`group_by_expert`), each expert's pairs added to `counts`."""
    groups = group_by_expert(ids, counts.shape[0])
    counts += torch.tensor(groups.counts, dtype=torch.long)
    return groups


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class ExpertsInDecodeStep:
    """What the C++ decode step (csrc/decode_step.cpp, `DecodeLayers.set_moe`) needs of a mixture-of-experts MLP
    with a `router_linear`, `experts`, `routing` and `expert_counts`: whether it can run it, for steps of how many
    rows, and `moe_block`'s arguments."""

    def decode_step_unavailable(self, dtype: torch.dtype) -> str | None:
        """Why the C++ decode step cannot run this MLP in a `dtype` model; None when it can (its decode steps of up
        to `decode_step_rows` rows then run `moe_block` there, the call `run_block` makes)."""
        router = self.router_linear
        if type(router) is not RouterLinear or router.weight.dtype != dtype:
            return "its router is not a plain linear in the model's dtype (model.deterministic tiles it)"
        kernel = self.experts.grouped_kernel() if self.experts.kernel_rows != 0 else "it is turned off"
        if not isinstance(kernel, GroupedExpertWeights) or kernel.dtype != dtype:
            return f"its experts are not on the grouped-experts kernel in the model's dtype ({kernel})"
        return None

    def decode_step_rows(self) -> int | None:
        """The most rows of a decode step the C++ step runs this MLP for (None: any): any where it takes larger
        steps as `moe_step` runs them (`decode_step_rows_args`), else those of one kernel call (`run_block`):
        routed in C++ and taken by the grouped kernel whatever their routing."""
        if self.decode_step_rows_args() is not None:
            return None
        limit = _pairs_limit(self.experts, self.experts.grouped_kernel())
        return ROUTE_KERNEL_ROWS if limit is None else min(ROUTE_KERNEL_ROWS, limit)

    def decode_step_rows_args(self) -> tuple | None:
        """What `DecodeLayers.set_moe_rows` takes for steps of any rows, as `moe_step` runs them: the router's
        `PackedLinear` (its product past `ROUTE_KERNEL_ROWS` rows, then PyTorch's softmax and top-k), those rows, the
        grouped kernel's pairs limit (-1: none), rows per pass and each expert's own packed gate_up and down weights
        past it (`run_routed`). None where the router is not packed or the experts have no weights of their own past
        a limit (`GroupedExpertWeights.linears`)."""
        packed = self.router_linear.packed_linear
        kernel = self.experts.grouped_kernel()
        limit = _pairs_limit(self.experts, kernel)
        if not isinstance(packed, PackedLinear) or (limit is not None and kernel.linears is None):
            return None
        gate_up, down = kernel.linears if limit is not None else ([], [])
        return (packed, ROUTE_KERNEL_ROWS, -1 if limit is None else limit, pass_rows(kernel.intermediate),
                list(gate_up), list(down))

    def decode_step_shared(self) -> tuple[nn.Module, nn.Module, nn.Module] | None:
        """A shared expert's gate/up and down linears and its sigmoid gate, which the C++ step runs beside
        `decode_step_args`' kernel call; None without one."""
        return None

    def decode_step_args(self) -> tuple:
        """`moe_block`'s arguments but x, as the C++ decode step takes them (`DecodeLayers.set_moe`)."""
        kernel, routing, router = self.experts.grouped_kernel(), self.routing, self.router_linear
        bias = router.bias if router.bias is not None else torch.empty(0, dtype=router.weight.dtype)
        return (router.weight, bias, routing.top_k, routing.mode, routing.renormalize, routing.weights_in_dtype,
                self.expert_counts, kernel.gate_up, kernel.down, kernel.intermediate, kernel.packed, *kernel.options())


class SparseMoeBlock(ExpertsInDecodeStep, nn.Module):
    """A decoder layer's MLP as a mixture of experts: the router ``gate`` [E, H], the ``experts``, and where the
    model has one (Qwen2-MoE) a ``shared_expert`` every token runs, scaled by ``sigmoid(shared_expert_gate(x))``.

    `expert_tokens` counts the (token, expert) pairs routed to each expert since start: the load ``/metrics``
    reports (``sage:moe_expert_tokens``).

    A step runs as `moe_step` says: where the grouped kernel takes it whatever its routing, routing, grouping and
    experts in one C++ call; otherwise routed (`route_tokens`), the pairs grouped here (`group_by_expert`), and the
    experts run grouped or one by one."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_expert: nn.Module | None = None, weights_in_hidden_dtype: bool = True) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        # transformers rounds the top-k weights to the hidden dtype before scaling (Qwen, OLMoE), Mixtral not
        self.weights_in_hidden_dtype = weights_in_hidden_dtype
        self.routing = Routing(top_k, SOFTMAX_TOP_K, renormalize, weights_in_hidden_dtype)
        self.gate = RouterLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        self.expert_counts = expert_counter(num_experts)

    @property
    def expert_tokens(self) -> list[int]:
        return self.expert_counts.tolist()

    @property
    def router_linear(self) -> nn.Module:
        return self.gate

    def decode_step_unavailable(self, dtype: torch.dtype) -> str | None:
        if self.shared_expert is not None and self.shared_expert.gate_up_proj is None:
            return "its shared expert's gate and up are not one stacked linear"
        return super().decode_step_unavailable(dtype)

    def decode_step_shared(self) -> tuple[nn.Module, nn.Module, nn.Module] | None:
        shared = self.shared_expert
        return None if shared is None else (shared.gate_up_proj, shared.down_proj, self.shared_expert_gate)

    def fuse_projections(self) -> int:
        """Before packing (`model.linear`): each expert its own linears, gate and up stacked, and the shared
        expert's; how many gate/up pairs were stacked."""
        fused = 0 if self.experts.keeps_stack() else self.experts.split_linears()
        return fused + (self.shared_expert.fuse_projections() if self.shared_expert is not None else 0)

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """x [T, H] (the layer's normed input) -> [T, H]."""
        out = moe_step(self.gate, self.experts, x, self.routing, self.expert_counts, ops)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return out
