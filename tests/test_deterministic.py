"""`model.deterministic` (`--deterministic`): a request's tokens and logprobs do not depend on what else is
batched with it.

Two levels: `RowTiledLinear` gives each row the same bits whether it is multiplied alone, among others, or at
another position of the batch; and the engine gives each prompt the same greedy tokens and the same logprobs,
to the bit, served alone and served among other requests with chunked prefill cutting prompts differently.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError
from sage_infer.layers.batch_invariant import RowTiledLinear, tile_linears
from sage_infer.layers.cpu_kernels import kernel_unavailable
from sage_infer.layers.linear import BF16_ROWS_KERNEL, PackedLinear, packing_unavailable
from tests.tiny_models import make_tiny_model

needs_kernels = pytest.mark.skipif(kernel_unavailable() is not None,
                                   reason=f"the paged decode kernel: {kernel_unavailable()}")


def linear(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    plain = nn.Linear(192, 160, bias=True).to(dtype)
    if kind == "torch":
        return plain
    return PackedLinear(plain)  # bf16 that oneDNN cannot pack: an fp32 copy, and the bf16 rows kernel


def assert_rows_invariant(tiled: RowTiledLinear, x: torch.Tensor) -> None:
    """Each row of `x` gets the same bits alone, among others, and at other positions, and what `inner` gives."""
    together = tiled(x)
    torch.testing.assert_close(together, tiled.inner(x), rtol=2e-2 if x.dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    for i in (0, 7, 16, 52):
        assert torch.equal(tiled(x[i : i + 1])[0], together[i])  # alone
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(tiled(x[order]), together[order])  # other neighbours, other positions
    assert torch.equal(tiled(x[:5]), together[:5])
    assert tiled(x[:0]).shape == (0, tiled.out_features)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])  # a kept tile, or one per call
@pytest.mark.parametrize("kind", ["torch", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_row_gets_the_same_bits_alone_in_any_batch_and_at_any_position(kind, dtype, grad):
    tiled = RowTiledLinear(linear(kind, dtype), rows=16)
    with torch.inference_mode(not grad):
        assert_rows_invariant(tiled, torch.randn(53, 192).to(dtype))


@needs_kernels
def test_a_layer_with_a_few_row_kernel_is_tiled_at_its_rows_and_each_row_gets_the_same_bits():
    """PackedLinear on a bf16 weight oneDNN cannot pack (an AVX2 CPU) runs products of a few rows on its bf16
    rows kernel, which computes each row alone: unpadded chunks of that many rows there, padded 16-row tiles around
    the other layers."""
    torch.manual_seed(0)
    if packing_unavailable(torch.bfloat16) is None:
        pytest.skip("oneDNN packs bf16 on this CPU: PackedLinear has no bf16 rows kernel")
    model = nn.Sequential(PackedLinear(nn.Linear(192, 160).to(torch.bfloat16)), nn.Linear(160, 8))
    assert model[0].row_invariant_rows == BF16_ROWS_KERNEL
    assert tile_linears(model) == 2
    assert (model[0].rows, model[0].pad) == (BF16_ROWS_KERNEL, False) and (model[1].rows, model[1].pad) == (16, True)
    with torch.inference_mode():
        assert_rows_invariant(model[0], torch.randn(53, 192).to(torch.bfloat16))


def test_tile_linears_wraps_every_linear_once():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)), nn.Embedding(10, 8))
    assert tile_linears(model) == 2
    assert tile_linears(model) == 0
    assert isinstance(model[0], RowTiledLinear) and isinstance(model[2][0], RowTiledLinear)
    assert isinstance(model[3], nn.Embedding)


def engine(path, deterministic: bool, budget: int = 2048, **model) -> LLM:
    config = ServeConfig.model_validate({
        "model": {"path": str(path), "dtype": "fp32", "deterministic": deterministic, **model},
        "kv_pool": {"num_blocks": 256, "block_size": 16},
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": budget}})
    return LLM(config=config, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("deterministic") / "model", "qwen3")


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]


@needs_kernels
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16 on an AVX2 CPU: 4-row tiles on the bf16 rows kernel
def test_each_request_gets_the_tokens_and_logprobs_of_its_solo_run_to_the_bit(model_dir, dtype):
    """Eight prompts served alone, then together with twelve others under a small token budget (their prompts cut
    into other chunks, decode rows beside prefill rows, a shared prefix): identical tokens and logprobs."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    wanted = prompts(3, (1, 5, 16, 33, 70, 101, 150, 47))
    shared = wanted[6][:64]  # a prefix the prefix cache and the batch share with one of the wanted prompts
    others = prompts(4, (12, 90, 3, 200, 25, 64)) + [shared + p for p in prompts(5, (7, 30, 2, 60, 18, 44))]
    solo_llm = engine(model_dir, True, dtype=dtype)
    solo = [solo_llm.generate([p], params)[0].outputs[0] for p in wanted]
    batched_llm = engine(model_dir, True, budget=96, dtype=dtype)
    mixed = others[:6] + wanted[:4] + others[6:] + wanted[4:]
    outs = batched_llm.generate(mixed, params)
    together = {tuple(out.prompt_token_ids): out.outputs[0] for out in outs}
    for prompt, alone in zip(wanted, solo):
        batched = together[tuple(prompt)]
        assert batched.token_ids == alone.token_ids
        assert [entry[0] for entry in batched.logprobs] == [entry[0] for entry in alone.logprobs]  # bitwise floats
    batched_llm.engine.kv.block_manager.check_invariants()
    assert batched_llm.engine.kv.block_manager.num_used_blocks == 0


@needs_kernels
def test_deterministic_greedy_tokens_match_the_default_path_on_a_clear_model(model_dir):
    """The deterministic path computes the same model: on prompts without near ties its greedy tokens are the
    default path's (the reference it must not drift from)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batch = prompts(9, (4, 20, 48))
    fast = [o.outputs[0].token_ids for o in engine(model_dir, False).generate(batch, params)]
    exact = [o.outputs[0].token_ids for o in engine(model_dir, True).generate(batch, params)]
    agree = sum(a == b for a, b in zip(fast, exact))
    assert agree >= 2, (fast, exact)  # fp32: products summed in another order may flip one near tie at most


@needs_kernels
def test_what_deterministic_needs_is_a_config_error_naming_the_field(model_dir):
    with pytest.raises(ConfigError, match="model.deterministic"):
        engine(model_dir, True, attention="torch")
    with pytest.raises(ConfigError, match="model.decode_step: sage: model.deterministic"):
        engine(model_dir, True, decode_step="sage")
    llm = engine(model_dir, True)
    assert llm.engine.runner.attention.row_invariant and not llm.engine.runner.cascade_attention
    assert llm.engine.runner.step.name != "cpp-decode"


@needs_kernels
def test_the_deterministic_flag_reaches_the_engine_and_its_start_up_line(sage, model_dir):
    result = sage("llm", "generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
                  "--temperature", "0", "--preset", "cpu", "--set", "kv_pool.num_blocks=16", "--deterministic")
    assert result.code == 0, result.err
    assert "sage: resolved model.deterministic = on (" in result.err
    assert "sage: resolved model.decode_step = python (auto: model.deterministic" in result.err
    off = sage("llm", "generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
               "--preset", "cpu", "--set", "kv_pool.num_blocks=16")
    assert off.code == 0 and "model.deterministic" not in off.err
