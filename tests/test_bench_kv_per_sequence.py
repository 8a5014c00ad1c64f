"""bench/kv_per_sequence.py on a tiny Gemma 3 (6 layers, 5 sliding with a window of 16 : 1 full): the pool's
measured KV per sequence, its full-attention twin's, and the accounting agree."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from bench.kv_per_sequence import accounted, full_attention_twin, peak_kv_bytes
from tests.tiny_models import save_tokenizer

WINDOW, PROMPT, NEW = 16, 64, 4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                           num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                           max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                                           pad_token_id=2, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                           layer_types=["sliding_attention"] * 5 + ["full_attention"])
    directory = tmp_path_factory.mktemp("kvseq") / "model"
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, 512)
    return directory


def test_measured_kv_per_sequence_matches_the_accounting(gemma3, tmp_path):
    twin = full_attention_twin(gemma3, tmp_path)
    assert json.loads((twin / "config.json").read_text())["layer_types"] == ["full_attention"] * 6
    prompt = [random.Random(0).randrange(3, 512) for _ in range(PROMPT)]
    hybrid, full = peak_kv_bytes(gemma3, prompt, NEW), peak_kv_bytes(twin, prompt, NEW)
    books = accounted(gemma3, PROMPT + NEW)
    assert books["model_ratio"] == pytest.approx((1 * 68 + 5 * WINDOW) / (6 * 68))
    assert full == books["full_attention_bytes"]  # 5 blocks of 16 tokens per layer
    # a sliding layer keeps its window and a block's slack between steps, not the 4 windows of the prompt
    assert 0 < hybrid <= books["bytes"] and hybrid / full <= 0.5
