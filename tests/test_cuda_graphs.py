"""`model.cuda_graphs`: pure decode steps replayed as CUDA graphs over static, padded input buffers.

Here (no GPU) the same padded static-buffer step runs eagerly (``DecodeGraphs(capture=False)``) with the C++
paged kernel: the buffers, the bucket padding and the pure-decode rule are checked token for token against
the engine's own steps. On a GPU the captured graphs are checked the same way, and against the torch path."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.core.sequence import Sequence
from sage_infer.engine.steps.cuda_graphs import DecodeGraphs, GraphStep
from sage_infer.errors import ConfigError
from sage_infer.layers.cpu_kernels import kernel_unavailable
from tests.tiny_models import greedy_tokens, make_tiny_model

CUDA = torch.cuda.is_available()
TOKENS = 14  # greedy tokens per prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graphs") / "m", "qwen3", num_hidden_layers=3)


def llm(path, device: str = "cpu", dtype: str = "fp32", max_num_seqs: int = 64, **model) -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype, **model},
                                         "kv_pool": {"num_blocks": 256}, "scheduler": {"max_num_seqs": max_num_seqs}})
    return LLM(config=config, device=device)


def prompts(seed: int = 0, count: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(1, 150))] for _ in range(count)]


def test_buckets_end_at_the_schedulers_batch_and_only_pure_decode_steps_fit():
    graphs = DecodeGraphs(torch.nn.Identity(), _pool(), torch.device("cpu"), max_batch=20, max_blocks=4,
                          capture=False)
    assert graphs.buckets == [1, 2, 4, 8, 16, 20]
    big = DecodeGraphs(torch.nn.Identity(), _pool(), torch.device("cpu"), max_batch=4096, max_blocks=4, capture=False)
    assert big.buckets[-1] == 512 and big.inputs.shape == (4, 512)  # larger batches run eagerly
    decoding = seq([5, 6, 7], [3], computed=2)  # computes its last token
    assert graphs.fits([decoding], [1])
    chunk = seq([5, 6, 7, 8], [4], computed=2)  # one token, not the last
    assert not graphs.fits([decoding, chunk], [1, 1])
    assert not graphs.fits([seq([5, 6, 7], [1])], [3])  # a prefill
    assert not graphs.fits([decoding] * 21, [1] * 21)  # more rows than the largest bucket
    long = seq(list(range(80)), [0, 1, 2, 3, 5], computed=79)
    assert not graphs.fits([long], [1])  # wider than the static block tables
    assert not graphs.fits([], [])


def seq(tokens: list[int], table: list[int], computed: int = 0) -> Sequence:
    made = Sequence(0, "r", 0, tokens, len(tokens), SamplingParams(), b"")
    made.block_table, made.num_computed_tokens = table, computed
    return made


def _pool():
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.kv_runtime import KVPool

    return KVPool(KVCacheSchema(1, 2, 16, 16, KVDtype.FP32), 8)


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"paged kernel: {kernel_unavailable()}")
@pytest.mark.parametrize("max_num_seqs", [64, 5])
def test_padded_static_buffer_steps_give_the_engines_tokens(tiny, max_num_seqs):
    """The graph step's inputs, eagerly: 11 prompts in buckets of up to 16 (padded rows repeat row 0), and
    with max_num_seqs 5 the batch still fits the largest bucket (5) as requests finish and join."""
    batch = prompts()
    want = greedy_tokens(llm(tiny, attention="paged", max_num_seqs=max_num_seqs), batch, TOKENS)
    padded = llm(tiny, attention="paged", max_num_seqs=max_num_seqs)
    runner = padded.engine.runner
    assert not isinstance(runner.step, GraphStep)  # auto on a CPU: off
    runner.step = GraphStep(runner.model, runner.pool, runner.device, max_num_seqs,
                            max_blocks=-(-1024 // runner.pool.block_size), capture=False, attention=runner.attention)
    graphs = runner.step.graphs
    assert greedy_tokens(padded, batch, TOKENS) == want
    assert graphs.replays >= 13  # every decode step after the prompts' prefills
    padded.engine.kv.block_manager.check_invariants()


def test_on_without_a_cuda_device_is_one_config_error_and_auto_is_off(tiny):
    with pytest.raises(ConfigError, match=r"^model.cuda_graphs: on: CUDA graphs need an NVIDIA CUDA device "
                                          r"\(device is cpu\)"):
        llm(tiny, cuda_graphs="on")
    assert not isinstance(llm(tiny).engine.runner.step, GraphStep)


def test_other_backends_refuse_the_setting():
    from sage_infer.backends.native_only import refuse_native_only

    config = ServeConfig.model_validate({"model": {"cuda_graphs": "off"}})
    with pytest.raises(ConfigError, match="^model.cuda_graphs: off picks sage's own CUDA graph setting"):
        refuse_native_only(config, "vllm")


# -- on a GPU --------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")


@needs_gpu
def test_graphs_on_the_gpu_give_the_eager_steps_tokens_fp32(tiny):
    batch = prompts(1)
    graphed = llm(tiny, "cuda", cuda_graphs="on")
    graphs = graphed.engine.runner.step.graphs
    assert graphs.capture
    eager = llm(tiny, "cuda", cuda_graphs="off")
    assert greedy_tokens(graphed, batch, TOKENS) == greedy_tokens(eager, batch, TOKENS)
    assert graphs.replays >= 13 and 1 <= graphs.captures <= len(graphs.buckets)
    before = graphs.captures
    # replays of the captured buckets, same tokens
    assert greedy_tokens(graphed, batch, TOKENS) == greedy_tokens(graphed, batch, TOKENS)
    assert graphs.captures == before
    graphed.engine.kv.block_manager.check_invariants()


@needs_gpu
def test_graphs_on_the_gpu_equal_the_torch_path_and_stay_within_bf16_rounding(tiny):
    from tests.tiny_models import assert_within_bf16_drift

    batch = prompts(2)
    torch_path = llm(tiny, "cuda", attention="torch")
    assert greedy_tokens(llm(tiny, "cuda"), batch, TOKENS) == greedy_tokens(torch_path, batch, TOKENS)
    bf16 = llm(tiny, "cuda", "bf16")
    assert isinstance(bf16.engine.runner.step, GraphStep)
    eager = llm(tiny, "cuda", "bf16", cuda_graphs="off")
    assert_within_bf16_drift(greedy_tokens(bf16, batch, TOKENS), greedy_tokens(eager, batch, TOKENS))
