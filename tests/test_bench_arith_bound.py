"""bench/arith_bound.py's count of a workload's arithmetic (no timing here): every distinct prompt prefix
computed once, one row per output token after the first, causal attention pairs."""

from __future__ import annotations

import pytest

from bench.arith_bound import count_work, layer_shapes, model_shape

SHAPE = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 4, "intermediate_size": 16, "vocab_size": 10}


def test_a_shared_prefix_is_counted_once_and_decode_rows_attend_their_whole_context():
    work = count_work([[1, 2, 3], [1, 2, 4]], max_tokens=3, s=SHAPE)
    assert work["prompt_rows"] == 4  # 1, 2 shared; 3 and 4 each their own
    assert work["decode_rows"] == 4 and work["logit_rows"] == 6 and work["output_tokens"] == 6
    # per row: q/k/v 8 -> (2 + 2 * 1) * 4 = 16, o 8 -> 8, gate/up 8 -> 32, down 16 -> 8; 2 layers
    layer_weights = (8 * 16 + 8 * 8 + 8 * 32 + 16 * 8) * 2
    assert work["gemm_prefill_gflop"] == pytest.approx(2 * layer_weights * 4 / 1e9)
    assert work["gemm_decode_gflop"] == pytest.approx((2 * layer_weights * 4 + 2 * 8 * 10 * 6) / 1e9)
    # pairs: prompt rows at depths 1, 2, 3, 3; decode rows over 4 and 5 keys, for each prompt
    pairs = (1 + 2 + 3 + 3) + 2 * (4 + 5)
    assert work["attention_gflop"] == pytest.approx(4 * 2 * 4 * 2 * pairs / 1e9)


def test_the_bench_shapes_are_the_built_models():
    qwen3 = model_shape("qwen3-11m")
    assert (qwen3["head_dim"], qwen3["vocab_size"], qwen3["max_position_embeddings"]) == (64, 4096, 4096)
    assert layer_shapes(qwen3) == [(384, 640), (384, 384), (384, 2048), (1024, 384)]
    demo = model_shape("demo")
    assert demo["head_dim"] == demo["hidden_size"] // demo["num_attention_heads"]


def test_a_mixture_of_experts_mlp_counts_a_tokens_top_k_experts():
    moe = {**SHAPE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 3}
    assert layer_shapes(moe)[2:] == [(8, 2 * 6), (6, 8)]  # 2 experts of 3: a dense MLP 6 wide, not 16
