"""`model.decode_step: sage` (csrc/decode_step.cpp): a pure decode step runs every decoder layer in one
C++ call. It chains the kernels the Python path calls one by one (sage's small-row kernel or oneDNN for
each product, as `PackedLinear` picks), on the same values in the same order, so greedy tokens are the
Python path's exactly, in bf16 too, not within drift."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer import LLM
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError
from sage_infer.layers.cpu_kernels import kernel_unavailable, small_linear_unavailable
from sage_infer.layers.linear import SMALL_LINEAR_ROWS, packing_unavailable
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
        self.step, self.calls, self.rows, self.cascade_rows = step, 0, [], []

    def run(self, h, *args):
        self.calls += 1
        self.rows.append(h.shape[0])
        if args[-2] is not None:  # the shared blocks of a cascade step
            self.cascade_rows.append(h.shape[0])
        return self.step.run(h, *args)


def counted(llm: LLM) -> CountingStep:
    step = llm.engine.runner.step
    step.handle = CountingStep(step.handle)
    return step.handle


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])  # q/k norms; q/k/v biases; llama3 rope scaling
def test_greedy_tokens_are_the_python_paths_exactly(tmp_path, arch, dtype):
    if dtype == "bf16" and small_linear_unavailable() is not None and packing_unavailable(torch.bfloat16) is None:
        pytest.skip(f"sage's small-row kernel: {small_linear_unavailable()}")
    path = make_tiny_model(tmp_path / arch, arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 9, 16, 40, 77, 130)]
    fast = engine(path, "sage", dtype=dtype)
    step = counted(fast)
    got = greedy_tokens(fast, prompts, max_tokens=24)
    assert step.calls >= 23 and max(step.rows) == len(prompts)  # every decode step went through C++
    assert got == greedy_tokens(engine(path, "python", dtype=dtype), prompts, max_tokens=24)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bf16", "auto"), ("fp32", "auto"), ("fp32", "int8")])
def test_sliding_window_layers_run_in_the_step_with_the_python_paths_tokens(tmp_path, dtype, kv_dtype):
    """Qwen2 with its last two of three layers sliding (window 16, two KV groups: a block table each, blocks out of
    the window freed): each layer stores and reads through its group's slots and tables and attends its window, for
    prompts past the window; over an int8 pool too."""
    if dtype == "bf16" and small_linear_unavailable() is not None and packing_unavailable(torch.bfloat16) is None:
        pytest.skip(f"sage's small-row kernel: {small_linear_unavailable()}")
    path = make_tiny_model(tmp_path / "sw", "qwen2", num_hidden_layers=3, head_dim=32, use_sliding_window=True,
                           sliding_window=16, max_window_layers=1)
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 21, 50)]
    fast = engine(path, "sage", dtype=dtype, kv_dtype=kv_dtype)
    step = counted(fast)
    got = greedy_tokens(fast, prompts, max_tokens=20)
    assert step.calls >= 19 and max(step.rows) == len(prompts)
    assert got == greedy_tokens(engine(path, "python", dtype=dtype, kv_dtype=kv_dtype), prompts, max_tokens=20)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_over_an_int8_pool_greedy_tokens_are_the_python_paths_exactly(tmp_path, dtype):
    """The C++ step quantizes K/V into the int8 pool as its store does and reads the codes in place with the
    kernel the Python path's decode rows use."""
    if dtype == "bf16" and small_linear_unavailable() is not None and packing_unavailable(torch.bfloat16) is None:
        pytest.skip(f"sage's small-row kernel: {small_linear_unavailable()}")
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    rng = random.Random(10)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 9, 16, 40, 77, 130)]
    fast = engine(path, "auto", dtype=dtype, kv_dtype="int8")
    step = counted(fast)
    got = greedy_tokens(fast, prompts, max_tokens=24)
    assert step.calls >= 23 and max(step.rows) == len(prompts)
    assert got == greedy_tokens(engine(path, "python", dtype=dtype, kv_dtype="int8"), prompts, max_tokens=24)


def test_over_an_int8_pool_a_shared_prefix_step_runs_in_python_with_the_same_tokens(tmp_path):
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    shared = list(range(5, 133))
    prompts = [shared + [300 + i] * (1 + i) for i in range(6)]
    fast, reference = (engine(path, choice, dtype="fp32", kv_dtype="int8") for choice in ("sage", "python"))
    for llm in (fast, reference):
        llm.engine.runner.cascade_min_saved_tokens = 32
    step = counted(fast)
    got = greedy_tokens(fast, prompts, max_tokens=12)
    assert not step.cascade_rows and fast.engine.runner.cascade_steps >= 10
    assert got == greedy_tokens(reference, prompts, max_tokens=12)


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


def shared_prefix_engines(path, dtype: str, prefill_attention: str) -> tuple[LLM, LLM]:
    """sage and python engines that attend a shared prefix together whenever 2+ decode rows share 2 blocks
    (fp32's default bar is 8,192 saved key reads, more than a tiny test's prompts hold)."""
    engines = [engine(path, choice, dtype=dtype, prefill_attention=prefill_attention) for choice in ("sage", "python")]
    for llm in engines:
        llm.engine.runner.cascade_min_saved_tokens = 32
    return engines[0], engines[1]


@pytest.mark.parametrize(("dtype", "prefill_attention"), [("bf16", "auto"), ("bf16", "torch"), ("fp32", "auto")])
def test_a_decode_step_over_a_shared_prefix_is_the_python_cascade_exactly(tmp_path, dtype, prefill_attention):
    """bf16 attends the shared blocks with sage's flash kernel (auto; PyTorch's on a CPU with AMX tiles) or
    PyTorch's (torch), fp32 with sage's fp32 kernel (auto)."""
    if dtype == "bf16" and small_linear_unavailable() is not None and packing_unavailable(torch.bfloat16) is None:
        pytest.skip(f"sage's small-row kernel: {small_linear_unavailable()}")
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    shared = list(range(5, 133))  # 8 blocks
    prompts = [shared + [300 + i] * (1 + i) for i in range(6)]
    fast, reference = shared_prefix_engines(path, dtype, prefill_attention)
    step = counted(fast)
    got = greedy_tokens(fast, prompts, max_tokens=12)
    assert step.cascade_rows.count(len(prompts)) >= 10
    assert got == greedy_tokens(reference, prompts, max_tokens=12)


def test_a_step_with_rows_outside_the_shared_prefix_runs_layer_by_layer(tmp_path):
    path = make_tiny_model(tmp_path / "q3", "qwen3")
    shared = list(range(5, 133))
    rng = random.Random(9)
    prompts = [shared + [300 + i] for i in range(4)] + [[rng.randrange(5, 500) for _ in range(20)] for _ in range(2)]
    fast, reference = shared_prefix_engines(path, "fp32", "auto")
    step = counted(fast)
    got = greedy_tokens(fast, prompts)
    # the 6-row steps attend the prefix in Python (2 rows are not in it); a step of only the last prompt tokens
    # of 3 prompts over the cached prefix (each one new token, all sharing) is a cascade decode step in C++
    assert len(prompts) not in step.rows and fast.engine.runner.cascade_steps >= 9
    assert got == greedy_tokens(reference, prompts)


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
    assert engine(path, "auto", dtype="fp32", kv_dtype="bf16").engine.runner.step.name == "fused"
    assert engine(path, "python").engine.runner.step.name == "fused"
    # at every ISA level: bf16 layers that oneDNN cannot pack (AVX2) run on fp32 copies and the bf16 rows kernel
    assert engine(path, "auto", dtype="fp32").engine.runner.step.name == "cpp-decode"
    assert engine(path, "auto").engine.runner.step.name == "cpp-decode"
