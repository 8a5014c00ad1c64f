"""bench/moe_decode.py: its arguments, and the layer / plain-read turns on a tiny MoE block (no model built)."""

from __future__ import annotations

import pytest
import torch

from bench.moe_decode import MOE_MODELS, parse_args, plain_read, timed_turns
from sage_infer.layers.elementwise import TORCH_OPS
from sage_infer.layers.moe import SparseMoeBlock

H, E, K, INTER = 16, 4, 2, 8


def test_the_moe_models_are_offered_and_bad_counts_refused():
    assert "qwen3-30b-a3b-2l" in MOE_MODELS
    args = parse_args([])
    assert args.model in MOE_MODELS and args.dtype == "bf16" and args.json is None and args.profile == []
    assert parse_args(["--profile", "1,8"]).profile == [1, 8]
    with pytest.raises(SystemExit):
        parse_args(["--iters", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--profile", "one"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "qwen3-11m"])  # a dense model has no experts to read


def test_turns_time_the_blocks_and_a_read_of_as_many_expert_tensors():
    torch.manual_seed(0)
    block = SparseMoeBlock(H, E, K, INTER, renormalize=True).requires_grad_(False)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    weights = {(0, e): torch.randn(3 * H * INTER) for e in range(E)}
    assert plain_read(list(weights.values())) > 0
    with torch.no_grad():
        turns = timed_turns({0: block}, weights, TORCH_OPS, H, torch.float32, iters=3, seed=0)
    assert set(turns) == {"layer_s", "read_s", "layer_s_min", "read_s_min"}
    assert all(v > 0 for v in turns.values())
    assert sum(block.expert_tokens) == (3 + 2) * K  # every turn, warm-ups included, ran the block on one row
