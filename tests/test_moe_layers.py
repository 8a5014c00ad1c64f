"""The MoE layer against plain per-token arithmetic: routing as each family defines it, and the grouped experts
(tokens sorted by expert, one product per expert) equal to a loop over every token and each of its experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sage_infer.layers import moe
from sage_infer.layers.batch_invariant import tile_linears
from sage_infer.layers.cpu_kernels import kernel_unavailable
from sage_infer.layers.elementwise import FUSED_OPS
from sage_infer.layers.moe import SparseMoeBlock, group_by_expert, route

E, H, INTER, K = 6, 32, 24, 2


def naive_moe(block: SparseMoeBlock, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Every token alone: its router softmax, its top-k, each chosen expert's MLP, weighted and summed."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[t], dim=0)
        top = sorted(range(E), key=lambda e: -float(probs[e]))[:K]
        weights = [float(probs[e]) for e in top]
        if block.renormalize:
            weights = [w / sum(weights) for w in weights]
        for e, w in zip(top, weights):
            gate, up = w13[e, :INTER] @ x[t], w13[e, INTER:] @ x[t]
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


def make_block(renormalize: bool, seed: int = 0) -> tuple[SparseMoeBlock, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    block = SparseMoeBlock(H, E, K, INTER, renormalize).requires_grad_(False)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
        block.experts.gate_up_proj.normal_(0, 0.2)
        block.experts.down_proj.normal_(0, 0.2)
    return block, block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()


def test_grouped_experts_equal_a_per_token_loop():
    for renormalize in (False, True):
        block, w13, w2 = make_block(renormalize)
        x = torch.randn(37, H)
        want = naive_moe(block, x, w13, w2)
        with torch.no_grad():
            torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
            block.fuse_projections()  # one linear pair per expert, as the engine packs them
            torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_expert_token_counts_add_up_to_tokens_times_top_k():
    block, _, _ = make_block(True)
    with torch.no_grad():
        block(torch.randn(5, H))
        block(torch.randn(11, H))
    assert sum(block.expert_tokens) == 16 * K
    assert sum(1 for n in block.expert_tokens if n) > K  # routing spreads tokens over experts


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")
def test_a_step_on_the_grouped_kernel_is_grouped_in_cpp_with_the_python_groupings_bits(monkeypatch):
    """With the fused ops, a step whose routing the kernel takes whatever it is never runs `group_by_expert`: the
    same bits and the same per-expert counts as the same routing grouped in Python over the same kernel."""
    block, _, _ = make_block(True)
    x = torch.randn(7, H)
    with torch.no_grad():
        with monkeypatch.context() as patch:
            patch.setattr(moe, "run_block", lambda *args: None)
            patch.setattr(moe, "run_routed", lambda *args: None)
            want = block(x, FUSED_OPS)
        want_counts = block.expert_tokens

        def refuse(*args):
            raise AssertionError("grouped in Python")

        monkeypatch.setattr(moe, "group_by_expert", refuse)
        got = block(x, FUSED_OPS)
    assert torch.equal(got, want)
    assert block.expert_tokens == [2 * n for n in want_counts] and sum(want_counts) == 7 * K


def test_groups_sort_pairs_by_expert_and_skip_idle_experts():
    ids = torch.tensor([[3, 0], [0, 5], [3, 5]])
    groups = group_by_expert(ids, E)
    assert groups.counts == [2, 0, 0, 2, 0, 2]
    assert groups.spans == [(0, 0, 2), (3, 2, 4), (5, 4, 6)]
    assert groups.tokens.tolist() == [0, 1, 0, 2, 1, 2]  # expert 0: tokens 0, 1; expert 3: 0, 2; expert 5: 1, 2
    assert groups.by_token.tolist() == [0, 2, 1, 4, 3, 5]  # token 0: experts 0, 3; token 1: 0, 5; token 2: 3, 5


def test_mixtral_top_k_then_softmax_is_the_renormalized_route():
    logits = torch.randn(9, 8)
    weights, ids = route(logits, 2, renormalize=True)
    top = logits.topk(2, dim=-1)
    torch.testing.assert_close(weights, torch.softmax(top.values, dim=-1))
    assert torch.equal(ids, top.indices)
    plain, _ = route(logits, 2, renormalize=False)  # Qwen / OLMoE without norm_topk_prob: the full softmax's share
    torch.testing.assert_close(plain, torch.softmax(logits, dim=-1).topk(2, dim=-1).values)
    assert bool((plain.sum(-1) < 1).all())


def test_a_row_tiled_moe_layer_gives_each_token_the_same_bits_in_any_batch():
    """`model.deterministic`: the router and every expert's linears row-tiled, so a token's routing, its experts'
    products and their sum do not depend on the tokens beside it."""
    block, _, _ = make_block(True)
    block.experts.split_linears()  # as the engine's model.deterministic does
    tile_linears(block, 16)
    x = torch.randn(41, H)
    with torch.no_grad():
        together = block(x)
        for i in (0, 9, 40):
            assert torch.equal(block(x[i : i + 1])[0], together[i])
        order = torch.randperm(41, generator=torch.Generator().manual_seed(1))
        assert torch.equal(block(x[order]), together[order])
