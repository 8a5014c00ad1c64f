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


def test_moe_rows_times_each_layout_and_writes_the_crossover(tmp_path):
    """bench/moe_rows.py on a tiny shape: every layout either times both paths at each step size or says why the
    kernel does not run it here; bad arguments are refused."""
    import json

    from bench import moe_rows

    with pytest.raises(SystemExit):
        moe_rows.parse_args(["--layouts", "packed-bf16"])
    with pytest.raises(SystemExit):
        moe_rows.parse_args(["--shape", "4,16,8,5"])  # top-k above the experts
    out = tmp_path / "rows.json"
    assert moe_rows.main(["--shape", "4,32,32,2", "--rows", "1,6", "--iters", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["layouts"]) == set(moe_rows.LAYOUTS)
    for layout in report["layouts"].values():
        if "skipped" in layout:
            assert layout["skipped"]  # the reason
            continue
        assert [r["rows"] for r in layout["results"]] == [1, 6]
        for r in layout["results"]:
            assert r["kernel_ms"] > 0 and r["per_expert_ms"] > 0 and 1 <= r["max_pairs"] <= r["rows"]
