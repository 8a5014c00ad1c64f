"""Loads written into the pool layer by layer (`KVPool.load_rows` with `kv_pool.layer_loads`): each layer is in
the pool when its attention asks (`ready`), whole-pool reads see every layer, the rows go back to their owner only
after the copies; the Triton copy kernel (under the interpreter without a GPU) writes what `write_rows` writes; an
engine whose host-tier hit loads layer by layer gives a cold run's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from sage_infer import LLM
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, ScaleLayout
from sage_infer.errors import ConfigError
from sage_infer.kv_runtime.layer_loads import copy_layer_triton
from sage_infer.kv_runtime.pool import make_kv_pool
from sage_infer.layers.triton_paged import interpreting, triton
from tests.test_kv_tiers_engine import BLOCK, A, B, C, run

LAYERS = 3


def pool_and_rows(dtype: KVDtype = KVDtype.FP32, n: int = 3, seed: int = 0):
    pool = make_kv_pool(KVCacheSchema(num_layers=LAYERS, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype),
                        num_blocks=8)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn((n, *pool.block_shape), generator=gen).to(pool.dtype)
    return pool, blocks.view(torch.uint8).view(n, -1).clone()


def test_each_layer_is_written_when_its_attention_asks_and_the_rows_go_back_after_the_step():
    pool, rows = pool_and_rows()
    expected = make_kv_pool(pool.schema, num_blocks=8)
    ids = [6, 1, 4]
    expected.write_rows(ids, rows)
    released = []
    pool.enable_layer_loads()
    pool.load_rows(ids, rows, released.append)
    assert pool.layer_loads.pending and not released
    assert not pool._kv.any()  # nothing written before a reader asks
    pool.ready(1)
    assert torch.equal(pool._kv[:, 1], expected._kv[:, 1])
    assert not pool._kv[:, 0].any() and not pool._kv[:, 2].any()
    pool.ready(0)
    pool.ready(2)
    assert torch.equal(pool._kv, expected._kv)
    assert pool.layer_loads.layers_waited == LAYERS and not released
    pool.finish_loads()
    assert len(released) == 1 and released[0] is rows
    assert not pool.layer_loads.pending


@pytest.mark.parametrize("reader", ["read_blocks", "write_blocks", "finish_loads"])
def test_a_whole_pool_access_or_a_step_that_never_asked_sees_every_layer(reader):
    pool, rows = pool_and_rows()
    expected = make_kv_pool(pool.schema, num_blocks=8)
    expected.write_rows([0, 2, 5], rows)
    pool.enable_layer_loads()
    released = []
    pool.load_rows([0, 2, 5], rows, released.append)
    if reader == "read_blocks":
        assert torch.equal(pool.read_blocks([0, 2, 5]), expected.read_blocks([0, 2, 5]))
    elif reader == "write_blocks":  # another block written whole: the queued load lands first, then it
        other = expected.read_blocks([0])
        pool.write_blocks([7], other)
        expected.write_blocks([7], other)
    else:  # after a step whose attention never asked
        pool.finish_loads()
    assert torch.equal(pool._kv, expected._kv)
    assert released == [rows]  # and the rows went back: no copy reads them any more


def test_without_layer_loads_rows_are_written_at_once_and_released():
    pool, rows = pool_and_rows()
    released = []
    pool.load_rows([3, 4, 5], rows, released.append)
    assert released == [rows]
    assert torch.equal(pool.read_blocks([3, 4, 5]).view(torch.uint8).view(3, -1), rows)


def test_a_quantized_pool_loads_whole():
    pool = make_kv_pool(KVCacheSchema(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=KVDtype.INT8,
                                      scale_layout=ScaleLayout.PER_TOKEN),
                        num_blocks=2)
    with pytest.raises(ValueError, match="loads whole"):
        pool.enable_layer_loads()


@pytest.mark.skipif(triton is None or not (torch.cuda.is_available() or interpreting()),
                    reason="triton is not installed" if triton is None else "no CUDA GPU and TRITON_INTERPRET is not 1")
@pytest.mark.parametrize("dtype", [KVDtype.FP32, KVDtype.BF16])
def test_the_triton_copy_writes_each_layer_as_write_rows_does(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool, rows = pool_and_rows(dtype, n=4, seed=1)
    expected = make_kv_pool(pool.schema, num_blocks=8)
    ids = [7, 0, 3, 5]
    expected.write_rows(ids, rows)
    kv = torch.zeros_like(pool._kv, device=device)
    src = rows.pin_memory() if device == "cuda" else rows
    src = src.view(pool.dtype).view(4, *pool.block_shape)
    for layer in (2, 0):  # one layer at a time: the others stay untouched
        copy_layer_triton(kv, src, torch.tensor(ids, device=device), layer)
    assert not kv[:, 1].any()
    copy_layer_triton(kv, src, torch.tensor(ids, device=device), 1)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(kv.cpu(), expected._kv)


def make_llm(model_dir, layer_loads: str, decode_step: str = "auto", **tiers) -> LLM:
    config = ServeConfig(
        model=ModelConfig(path=str(model_dir), dtype="fp32", decode_step=decode_step),
        kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=8, layer_loads=layer_loads),
        scheduler=SchedulerConfig(max_num_seqs=1),
        tiers=TierConfig(**tiers),
    )
    return LLM(config=config, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("layer-loads") / "model", "llama")


@pytest.mark.parametrize("decode_step", ["python", "auto"])
def test_a_host_tier_hit_loaded_layer_by_layer_gives_the_cold_tokens(model_dir, decode_step):
    """`auto` takes the C++ decode step where the kernels are built: its steps read the pool outside attention."""
    cold = run(make_llm(model_dir, "off", decode_step), A)[0]
    llm = make_llm(model_dir, "on", decode_step, host_bytes=1 << 20)
    loads = llm.engine.runner.pool.layer_loads
    assert loads is not None
    for tokens in (A, B, C):  # B and C need the pool: A's cached blocks are demoted
        run(llm, tokens)
    assert run(llm, A) == (cold, 5 * BLOCK)
    assert loads.loads == 1 and not loads.pending
    for tokens in (B, C):
        run(llm, tokens)
    steps, before = llm.engine.load_rates.steps.observations, loads.loads
    assert run(llm, A + list(range(7, 27)))[1] == 5 * BLOCK  # 5 blocks loaded, 21 tokens computed over them
    # the step that waited for the copies is not fitted as compute (their time would read as the step's)
    assert loads.loads == before + 1 and llm.engine.load_rates.steps.observations == steps
    assert loads.layers_waited >= 1  # the first step's attention asked (a C++ step finishes them all at once)
    decided = {value.field: value for value in llm.engine.decisions}["kv_pool.layer_loads"]
    assert decided.value == "on"
    llm.engine.kv.block_manager.check_invariants()


def test_auto_on_a_cpu_loads_whole_and_on_for_a_quantized_pool_is_refused(model_dir):
    llm = make_llm(model_dir, "auto", host_bytes=1 << 20)
    assert llm.engine.runner.pool.layer_loads is None
    decided = {value.field: value for value in llm.engine.decisions}["kv_pool.layer_loads"]
    assert (decided.value, "CPU pool" in decided.reason) == ("off", True)
    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                         kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=8, kv_dtype="int8", layer_loads="on"))
    with pytest.raises(ConfigError, match="kv_pool.layer_loads: on: a int8 pool"):
        LLM(config=config, device="cpu")


def test_layer_loads_is_inactive_where_nothing_is_loaded_at_admission(tmp_path):
    from sage_infer.config.inactive import inactive_reason

    def config(**fields):
        return ServeConfig(kv_pool=KVPoolConfig(layer_loads="on"), **fields)

    assert "lower KV tier" in inactive_reason("kv_pool.layer_loads", config(tiers=TierConfig(host_bytes=0)))
    assert inactive_reason("kv_pool.layer_loads", config(tiers=TierConfig(host_bytes=0, disk_path=str(tmp_path),
                                                                          disk_bytes=1 << 20))) is None
    assert inactive_reason("kv_pool.layer_loads", config(tiers=TierConfig(host_bytes=0), role="decode")) is None


def test_a_decode_instance_writes_received_blocks_layer_by_layer_and_continues_token_for_token(model_dir):
    """A prefill/decode transfer lands through the same admission path: with layer loads on, the decode engine's
    received blocks are written one layer at a time and its tokens are the colocated engine's."""
    from sage_infer.config.transport import KVTransportConfig
    from sage_infer.core.sampling_params import SamplingParams
    from tests.test_kv_transfer_engine import PROMPT, hand_off

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def engine(role: str, layer_loads: str = "auto"):
        config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                             kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=32, layer_loads=layer_loads),
                             role=role, kv_transport=KVTransportConfig(backend="shm"))
        return LLM(config=config, device="cpu").engine

    [colocated] = LLM(config=ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                                         kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=32)),
                      device="cpu").generate([PROMPT], greedy)
    prefill, decode = engine("prefill"), engine("decode", "on")
    final, sent = hand_off(prefill, decode, PROMPT, greedy)
    assert sent == 5 and final.outputs[0].token_ids == colocated.outputs[0].token_ids
    assert final.metrics.num_cached_tokens == 5 * BLOCK
    loads = decode.runner.pool.layer_loads
    assert loads.loads == 1 and loads.layers_waited >= 1 and not loads.pending
    for each in (prefill, decode):
        each.kv.block_manager.check_invariants()
        each.shutdown()
