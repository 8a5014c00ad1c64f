"""The Triton grouped experts (`sage_infer.layers.triton_moe`: every active expert of a step in one gate/up launch
with the activation fused and one down launch with the routing weights applied) against the per-expert PyTorch loop
(`moe.run_grouped`, the oracle), for `FusedExperts`' SwiGLU experts and gpt-oss's clamped SwiGLU with biases, fp32 and
bf16, decode-sized and prefill-sized steps. Without a GPU the kernels run under Triton's interpreter
(tests/conftest.py), on small shapes."""

from __future__ import annotations

import pytest
import torch

from sage_infer.layers.moe import FusedExperts, group_by_expert, route
from sage_infer.layers.moe_swiglu import ClampedSwigluExperts
from sage_infer.layers.triton_moe import align_blocks, block_rows, cuda_experts, triton_experts
from sage_infer.layers.triton_paged import interpreting, triton
from tests.triton_variants import compiled_variants

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    triton is None or not (CUDA or interpreting()),
    reason="triton is not installed" if triton is None else "no CUDA GPU and TRITON_INTERPRET is not 1")
# bf16: the kernels round where the PyTorch path does, but accumulate each product in one fp32 sum
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=3e-3, rtol=3e-3)}
E, H, WIDTH = 4, 96, 80  # H and WIDTH: more than one 64-wide tile, neither a multiple of it


def routed(tokens: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    weights, ids = route(torch.randn(tokens, E, generator=gen), top_k, renormalize=True)
    return x, weights.to(dtype), group_by_expert(ids, E)


def test_blocks_start_each_expert_on_a_block_of_its_own():
    slots, experts = align_blocks([3, 0, 17, 16], 16, torch.device("cpu"))
    assert experts.tolist() == [0, 2, 2, 3]
    want = list(range(3)) + [36] * 13 + list(range(3, 20)) + [36] * 15 + list(range(20, 36))
    assert slots.tolist() == want


@pytest.mark.parametrize("dtype, tokens, top_k", [  # blocks of 16 pairs (decode), of 64 (prefill)
    (torch.float32, 5, 2), (torch.float32, 130, 2), (torch.bfloat16, 5, 2), (torch.bfloat16, 130, 2),
    (torch.float16, 5, 2)])
def test_swiglu_experts_equal_the_per_expert_loop(dtype, tokens, top_k):
    gen = torch.Generator().manual_seed(1)
    experts = FusedExperts(E, H, WIDTH).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * WIDTH, H, generator=gen) * H**-0.5)
        experts.down_proj.copy_(torch.randn(E, H, WIDTH, generator=gen) * WIDTH**-0.5)
    x, weights, groups = routed(tokens, top_k, dtype, seed=tokens)
    assert block_rows(len(groups.order), len(groups.spans)) == (16 if tokens < 64 else 64)
    want = experts(x, weights, groups)  # the TORCH_OPS per-expert loop
    got = triton_experts(experts.to(DEVICE), x.to(DEVICE), weights.to(DEVICE), groups_on(groups))
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[dtype])


@pytest.mark.skipif(not CUDA, reason="compiled kernels exist on a CUDA GPU only")
def test_steps_of_any_size_reuse_the_compiled_kernels():
    """1, 8, 5 and 3 tokens (2, 16, 10 and 6 pairs, blocks of 16): the pairs' count is not specialized on, so a
    step of a new size never waits for a compile."""
    from sage_infer.layers.triton_moe import _kernels

    experts = FusedExperts(E, H, WIDTH).to(torch.bfloat16).to(DEVICE)
    counts = []
    for tokens in (1, 8, 5, 3):
        x, weights, groups = routed(tokens, 2, torch.bfloat16, seed=tokens)
        triton_experts(experts, x.to(DEVICE), weights.to(DEVICE), groups_on(groups))
        torch.cuda.synchronize()
        counts.append(tuple(compiled_variants(kernel) for kernel in _kernels()))
    assert len(set(counts)) == 1, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_experts_with_biases_equal_the_per_expert_loop(dtype):
    """gpt-oss's layout (gate and up interleaved, [E, H, 2I] and [E, I, H]) with biases; a limit most gates and ups
    pass, so the clamps are taken."""
    gen = torch.Generator().manual_seed(2)
    experts = ClampedSwigluExperts(E, H, WIDTH, alpha=1.702, limit=0.5).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-2] ** -0.5 if p.dim() == 3
                    else torch.randn(p.shape, generator=gen) * 0.3)
    x, weights, groups = routed(9, 2, dtype, seed=3)
    want = experts(x, weights, groups)
    got = triton_experts(experts.to(DEVICE), x.to(DEVICE), weights.to(DEVICE), groups_on(groups))
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[dtype])


def groups_on(groups):
    from dataclasses import replace

    return replace(groups, order=groups.order.to(DEVICE), tokens=groups.tokens.to(DEVICE),
                   by_token=groups.by_token.to(DEVICE))


def test_experts_the_kernels_do_not_take_keep_the_per_expert_loop():
    """Experts split into linears (the CPU's packing), or weights in another dtype than x: None, the layer's loop
    runs them; off a CUDA device the layer never asks (`cuda_experts` says no)."""
    experts = FusedExperts(E, H, WIDTH)
    x, weights, groups = routed(3, 2, torch.float32, seed=4)
    assert cuda_experts(experts, x, weights, groups) is None  # a CPU tensor
    assert triton_experts(experts.to(torch.bfloat16), x, weights, groups) is None
    experts.split_linears()
    assert triton_experts(experts, x, weights, groups) is None


# -- the engine on a CUDA device ------------------------------------------------------------------


needs_gpu = pytest.mark.skipif(not CUDA, reason="the engine on a CUDA device needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_on_the_gpu_runs_the_experts_in_triton_and_matches_transformers(tmp_path, monkeypatch, family):
    """fp32 greedy tokens of a tiny MoE checkpoint on the GPU against transformers' (on the CPU; a mismatch only
    after a near-tie of its logits), every MoE layer's experts through the Triton launches."""
    from sage_infer import LLM
    from sage_infer.config.serve import ServeConfig
    from sage_infer.layers import triton_moe
    from tests.test_moe import GREEDY, assert_same_as_hf, hf_greedy, make_tiny_moe, prompts_with_a_shared_prefix

    hf = make_tiny_moe(tmp_path / "model", family)
    calls, kernel = [], triton_moe.swiglu_experts
    monkeypatch.setattr(triton_moe, "swiglu_experts", lambda *args: calls.append(1) or kernel(*args))
    config = ServeConfig.model_validate({"model": {"path": str(tmp_path / "model"), "dtype": "fp32"},
                                         "kv_pool": {"num_blocks": 64}})
    llm = LLM(config=config, device="cuda")
    prompts = prompts_with_a_shared_prefix()
    assert_same_as_hf(hf_greedy(hf, prompts), llm.generate(prompts, GREEDY))
    assert calls
