"""bench/cached_turn.py: a cached turn on the 11M model (no timing is asserted: what each figure counts)."""

from __future__ import annotations

import pytest

from bench.arith_bound import layer_shapes, model_shape
from bench.cached_turn import bound_seconds, main


def test_the_bound_counts_the_new_rows_gemms_their_attention_and_one_head_row():
    shape = model_shape("qwen3-11m")
    weights = sum(i * o for i, o in layer_shapes(shape)) * shape["num_hidden_layers"]
    per_pair = 4 * shape["num_attention_heads"] * shape["head_dim"] * shape["num_hidden_layers"]
    head = 2 * shape["hidden_size"] * shape["vocab_size"]
    gflop, seconds = bound_seconds(shape, history=10, new=2, rate_gflop_s=1.0)
    # two new rows: the first attends 10 + 1 keys, the second 10 + 2
    assert gflop == pytest.approx((2 * 2 * weights + per_pair * 23 + head) / 1e9)
    assert seconds == pytest.approx(gflop)


def test_a_run_finds_the_history_cached_and_reports_every_figure(tmp_path):
    report = main(["--model", "qwen3-11m", "--dtype", "fp32", "--history", "48", "--new", "8", "--repeats", "1",
                   "--gemm-repeats", "1", "--model-cache", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert report["sage"]["cached_tokens"] == 48  # three full blocks of the earlier turn
    assert report["sage"]["cached_s"] > 0 and report["sage"]["whole_s"] > 0
    assert report["hf"]["cached_s"] > 0 and report["bound_s"] > 0
    assert (tmp_path / "r.json").exists()
