"""`model.decode_step: sage` (csrc/decode_step.cpp): a pure decode step runs every decoder layer in one
C++ call. It chains the kernels the Python path calls one by one (sage's small-row kernel or oneDNN for
each product, as `PackedLinear` picks), on the same values in the same order, so greedy tokens are the
Python path's exactly, in bf16 too, not within drift."""

from __future__ import annotations

import random

import pytest

from sage_infer import LLM
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError
from sage_infer.layers.linear import SMALL_LINEAR_ROWS
from sage_infer.layers.paged_kernel import kernel_unavailable, small_linear_unavailable
from tests.tiny_models import greedy_tokens, make_tiny_model

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")
needs_small_linear = pytest.mark.skipif(small_linear_unavailable() is not None,
                                        reason=f"sage's small-row kernel: {small_linear_unavailable()}")


def engine(path, decode_step: str, dtype: str = "bf16", kv_dtype: str = "auto", **model) -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype, "decode_step": decode_step,
                                                   **model},
                                         "kv_pool": {"num_blocks": 160, "kv_dtype": kv_dtype},
                                         "scheduler": {"max_num_seqs": 48}})
    return LLM(config=config)


class CountingStep:
    """The C++ step of a model, counting the steps it ran."""

    def __init__(self, step) -> None:
        self.step, self.calls, self.rows = step, 0, []

    def run(self, h, *args):
        self.calls += 1
        self.rows.append(h.shape[0])
        return self.step.run(h, *args)


def counted(llm: LLM) -> CountingStep:
    model = llm.engine.runner.model
    pool, step = model.decode_step
    model.decode_step = (pool, CountingStep(step))
    return model.decode_step[1]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])  # q/k norms; q/k/v biases; llama3 rope scaling
def test_greedy_tokens_are_the_python_paths_exactly(tmp_path, arch, dtype):
    if dtype == "bf16" and small_linear_unavailable() is not None:
        pytest.skip(f"sage's small-row kernel: {small_linear_unavailable()}")
    path = make_tiny_model(tmp_path / arch, arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 9, 16, 40, 77, 130)]
    fast = engine(path, "sage", dtype=dtype)
    step = counted(fast)
    got = greedy_tokens(fast, prompts, max_tokens=24)
    assert step.calls >= 23 and max(step.rows) == len(prompts)  # every decode step went through C++
    assert got == greedy_tokens(engine(path, "python", dtype=dtype), prompts, max_tokens=24)


@needs_small_linear
def test_a_step_of_more_rows_than_the_small_row_kernel_takes_runs_its_products_on_onednn(tmp_path):
    path = make_tiny_model(tmp_path / "q2", "qwen2")
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 60))] for _ in range(SMALL_LINEAR_ROWS + 8)]
    fast = engine(path, "auto")
    step = counted(fast)
    got = greedy_tokens(fast, prompts)
    assert max(step.rows) == len(prompts) > SMALL_LINEAR_ROWS
    assert got == greedy_tokens(engine(path, "python"), prompts)


def test_a_step_with_a_shared_prefix_or_a_prefill_chunk_runs_layer_by_layer(tmp_path):
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    shared = list(range(5, 133))  # 8 blocks: the decode rows over it attend it together (cascade attention)
    prompts = [shared + [300 + i, 400 + i] for i in range(6)]
    fast = engine(path, "sage")
    step = counted(fast)
    got = greedy_tokens(fast, prompts)
    assert step.calls == 0 and fast.engine.runner.cascade_steps > 0
    assert got == greedy_tokens(engine(path, "python"), prompts)


def test_where_it_cannot_run_sage_is_a_config_error_and_auto_runs_python(tmp_path):
    path = make_tiny_model(tmp_path / "l", "llama")
    with pytest.raises(ConfigError, match="^model.decode_step: sage: it needs a KV pool in the model's dtype"):
        engine(path, "sage", dtype="fp32", kv_dtype="bf16")
    with pytest.raises(ConfigError, match="^model.decode_step: sage: it chains the fused elementwise ops"):
        engine(path, "sage", elementwise="torch")
    with pytest.raises(ConfigError, match="^model.decode_step: sage: it needs every projection packed"):
        engine(path, "sage", linear="torch")
    with pytest.raises(ConfigError, match="^model.decode_step: sage: it chains the paged decode kernel"):
        engine(path, "sage", attention="torch")
    assert engine(path, "auto", dtype="fp32", kv_dtype="bf16").engine.runner.model.decode_step is None
    assert engine(path, "python").engine.runner.model.decode_step is None
    assert engine(path, "auto").engine.runner.model.decode_step is not None
