"""A mixture-of-experts layer's routing in C++ (`cpu_kernels.moe_route`: the router's product, softmax and top-k)
against PyTorch's ops, at every ISA level: each family's routing (softmax then top-k, renormalized or not, weights in
fp32 or the hidden dtype; gpt-oss's top-k then softmax with the router's bias), a row's routing whatever its batch,
and a layer's step in one call (`moe_block`) against the routing and the routed experts called one after the other."""

from __future__ import annotations

import pytest
import torch

from sage_infer.layers import cpu_kernels, moe
from sage_infer.layers.cpu_kernels import kernel_unavailable
from sage_infer.layers.elementwise import FUSED_OPS, TORCH_OPS
from sage_infer.layers.linear import PackedLinear, pack_linears, packing_unavailable
from sage_infer.layers.moe import (
    SOFTMAX_TOP_K,
    TOP_K_SOFTMAX,
    RouterLinear,
    Routing,
    SparseMoeBlock,
    route_tokens,
)
from sage_infer.layers.moe_swiglu import TopKSoftmaxMoeBlock

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")

E, H, INTER = 64, 100, 32  # H not a multiple of any vector width: every level's tail runs
ROUTINGS = [Routing(4, SOFTMAX_TOP_K, False, True), Routing(4, SOFTMAX_TOP_K, True, True),
            Routing(2, SOFTMAX_TOP_K, True, False), Routing(4, TOP_K_SOFTMAX, False, True)]


def make_router(dtype: torch.dtype, bias: bool, seed: int = 0) -> RouterLinear:
    torch.manual_seed(seed)
    router = RouterLinear(H, E, bias=bias).requires_grad_(False)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        if bias:
            router.bias.normal_(0, 0.5)
    return router.to(dtype)


def chosen_are_a_top_k(got_ids: torch.Tensor, want_ids: torch.Tensor, values: torch.Tensor, slack: float) -> None:
    """Each token's experts in `got_ids` are a top k of `values` (the reference's per-expert scores) up to `slack`
    (rounding of the scores): where the reference's k-th and (k+1)-th differ by more, the same set."""
    top, _ = values.float().topk(got_ids.shape[1] + 1, dim=-1)
    for t in range(got_ids.shape[0]):
        chosen = values[t].float()[got_ids[t]]
        assert (chosen >= top[t, -2] - slack).all(), (t, chosen, top[t])
        if top[t, -2] - top[t, -1] > 2 * slack:
            assert set(got_ids[t].tolist()) == set(want_ids[t].tolist()), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ROUTINGS, ids=["softmax", "renormalized", "fp32-weights", "topk-softmax"])
def test_routing_in_cpp_picks_pytorchs_experts_with_its_weights(cpu_isa, dtype, routing):
    router = make_router(dtype, bias=routing.mode == TOP_K_SOFTMAX)
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        weights, ids = cpu_kernels.moe_route(x, router.weight, router.bias, routing.top_k, routing.mode,
                                             routing.renormalize, routing.weights_in_dtype)
        want, want_ids = route_tokens(router, x, routing, TORCH_OPS)
        logits = router(x)
        small = route_tokens(router, x[:moe.ROUTE_KERNEL_ROWS], routing, FUSED_OPS)  # a decode-sized step: the kernel
    assert torch.equal(small[0], weights[:moe.ROUTE_KERNEL_ROWS]) and torch.equal(small[1], ids[:moe.ROUTE_KERNEL_ROWS])
    assert ids.dtype == torch.long and ids.shape == (19, routing.top_k)
    assert weights.dtype == (dtype if routing.weights_in_dtype else torch.float32)
    if dtype == torch.float32:  # fp32 logits of random weights: no ties, the same experts in the same order
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want, rtol=1e-5, atol=1e-6)
        return
    # bf16 logits tie or differ by a rounding: the experts are a top k, each weighted as PyTorch weights it
    chosen_are_a_top_k(ids, want_ids, logits, slack=float(logits.float().abs().max()) * 2 ** -7)
    for t in range(x.shape[0]):  # the weights PyTorch gives the experts chosen
        chosen = logits[t, ids[t]].float()
        if routing.mode == TOP_K_SOFTMAX:
            expect = torch.softmax(chosen, dim=-1)
        else:
            expect = torch.softmax(logits[t].float(), dim=-1)[ids[t]]
            expect = expect / expect.sum() if routing.renormalize else expect
        torch.testing.assert_close(weights[t].float(), expect, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_routes_a_row_the_same_alone_or_in_a_batch(cpu_isa, dtype):
    """Each logit is summed in one order whatever the step's rows (70 rows: three blocks of tokens)."""
    router = make_router(dtype, bias=True)
    x = torch.randn(70, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    for r in ROUTINGS:
        args = (router.weight, router.bias, r.top_k, r.mode, r.renormalize, r.weights_in_dtype)
        weights, ids = cpu_kernels.moe_route(x, *args)
        for row in (0, 33, 69):
            alone_w, alone_ids = cpu_kernels.moe_route(x[row:row + 1].contiguous(), *args)
            assert torch.equal(alone_ids[0], ids[row]) and torch.equal(alone_w[0], weights[row]), (r, row)


def test_steps_past_the_kernels_rows_are_routed_by_pytorch(monkeypatch):
    router = make_router(torch.float32, bias=False)
    x = torch.randn(moe.ROUTE_KERNEL_ROWS + 1, H)

    def refuse(*args):
        raise AssertionError("routed in C++")

    monkeypatch.setattr(cpu_kernels, "moe_route", refuse)
    with torch.no_grad():
        weights, ids = route_tokens(router, x, ROUTINGS[1], FUSED_OPS)
        want, want_ids = route_tokens(router, x, ROUTINGS[1], TORCH_OPS)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want)


def test_equal_scores_go_to_the_lower_expert():
    router = make_router(torch.float32, bias=False)
    with torch.no_grad():
        router.weight[10:20] = router.weight[5]  # experts 5 and 10-19 score the same for every token
        router.weight[5] *= 4.0 / router.weight[5].norm()
    x = router.weight[5:6].clone()
    with torch.no_grad():
        _, ids = cpu_kernels.moe_route(x, router.weight, None, 3, SOFTMAX_TOP_K, False, False)
    assert ids[0].tolist() == [5, 10, 11]


def test_bad_routing_arguments_are_refused():
    router = make_router(torch.float32, bias=False)
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="top_k"):
        cpu_kernels.moe_route(x, router.weight, None, E + 1, SOFTMAX_TOP_K, False, False)
    with pytest.raises(RuntimeError, match="router must be"):
        cpu_kernels.moe_route(x, router.weight.bfloat16(), None, 2, SOFTMAX_TOP_K, False, False)
    with pytest.raises(RuntimeError, match="mode"):
        cpu_kernels.moe_route(x, router.weight, None, 2, 7, False, False)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.moe_route(x, router.weight, torch.zeros(E + 1), 2, SOFTMAX_TOP_K, False, False)


def test_packing_keeps_the_routers_plain_weight_beside_its_packed_copy():
    if packing_unavailable(torch.float32) is not None:
        pytest.skip(f"oneDNN cannot pack here: {packing_unavailable(torch.float32)}")
    router = make_router(torch.float32, bias=False)
    model = torch.nn.Sequential(router, torch.nn.Linear(H, H))
    x = torch.randn(12, H)
    with torch.no_grad():
        want = router(x)
        assert pack_linears(model) == 2
        assert model[0] is router and isinstance(model[1], PackedLinear)
        assert isinstance(router.packed_linear, PackedLinear) and router.weight.shape == (E, H)
        assert [name for name, _ in router.named_modules()] == [""]  # the packed copy is not a layer of its own
        torch.testing.assert_close(router(x), want, rtol=1e-5, atol=1e-5)


def make_block(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(3)
    if kind == "gpt-oss":
        block = TopKSoftmaxMoeBlock(H - 4, E, 4, INTER, alpha=1.702, limit=7.0)
    else:
        block = SparseMoeBlock(H - 4, E, 4, INTER, renormalize=kind == "qwen",
                               weights_in_hidden_dtype=kind != "mixtral")
    block.requires_grad_(False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["qwen", "mixtral", "gpt-oss"])
def test_a_layer_in_one_call_gives_the_bits_of_routing_then_the_routed_kernel(cpu_isa, monkeypatch, dtype, kind):
    """`moe_block` (routing, grouping and experts in one call) against `moe_route`, then `moe_experts_routed`, then
    (fp32) the PyTorch reference; the per-expert counts grow alike."""
    block = make_block(kind, dtype)
    x = torch.randn(3, H - 4, generator=torch.Generator().manual_seed(4)).to(dtype)  # 3: within every row limit
    calls = []
    real_block = cpu_kernels.moe_block
    monkeypatch.setattr(cpu_kernels, "moe_block", lambda *args: calls.append(1) or real_block(*args))
    with torch.no_grad():
        got = block(x, FUSED_OPS)
        got_counts = block.expert_counts.clone()
        assert calls, "the layer's step did not run in one call"
        with monkeypatch.context() as patch:
            patch.setattr(moe, "run_block", lambda *args: None)
            want = block(x, FUSED_OPS)
        reference = block(x, TORCH_OPS)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(block.expert_counts, 3 * got_counts) and int(got_counts.sum()) == 3 * 4
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)
