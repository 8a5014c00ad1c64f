"""Teacher-forced scoring through the engine (`score_windows`), checked against `transformers` itself."""

from __future__ import annotations

import pytest
import torch
import transformers

from sage_infer import LLM
from sage_infer.config.serve import KVPoolConfig, ModelConfig, ServeConfig
from sage_infer.models.loader import DEMO_MODEL_DIR
from sage_infer.quantization.evaluation import score_windows

TEXT = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.")


def engine(kv_dtype: str = "fp32"):
    config = ServeConfig(model=ModelConfig(dtype="fp32"), kv_pool=KVPoolConfig(kv_dtype=kv_dtype, num_blocks=64))
    return LLM(config=config, device="cpu").engine


@pytest.fixture(scope="module")
def windows():
    ids = engine().tokenizer.encode(TEXT)
    return torch.tensor([ids[:40], ids[5:45]])


def test_engine_scores_equal_transformers_in_fp32(windows):
    scores = score_windows(engine(), windows, keep_logits=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        ref = model(windows).logits[:, :-1].float()
    torch.testing.assert_close(scores.logits, ref, atol=2e-4, rtol=1e-4)
    ref_nll = torch.nn.functional.cross_entropy(ref.transpose(1, 2), windows[:, 1:], reduction="none")
    torch.testing.assert_close(scores.nll, ref_nll, atol=2e-4, rtol=1e-4)


def test_scoring_returns_its_blocks(windows):
    eng = engine()
    score_windows(eng, windows)
    assert eng.kv.block_manager.num_used_blocks == 0


def test_int8_kv_moves_perplexity_less_than_int4(windows):
    base = score_windows(engine(), windows).perplexity
    int8, int4 = (score_windows(engine(dt), windows).perplexity for dt in ("int8", "int4"))
    assert abs(int8 / base - 1) < abs(int4 / base - 1)  # the scores really went through the quantized pool
    assert int8 != base and abs(int8 / base - 1) < 0.01
