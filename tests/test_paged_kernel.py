"""The paged decode kernel (reads pool blocks in place) agrees with the pure-PyTorch oracle:
per layer against gathered-copy attention, and end to end as greedy tokens of the engine."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.kv_runtime import KVPool
from sage_infer.layers.attention import (
    AttentionMetadata,
    attention_with_lse_reference,
    decode_attention_reference,
    decode_groups,
    paged_attention,
)
from sage_infer.layers.attention_backends import PAGED_DECODE, REFERENCE, attention_backend, base
from sage_infer.layers.cpu_kernels import decode_attention_paged, flash_unavailable, kernel_unavailable
from tests.kv_fill import LAYER, LAYERS, filled_pool
from tests.tiny_models import assert_within_bf16_drift, greedy_tokens, make_tiny_model

# at every ISA level this CPU runs (conftest.cpu_isa)
pytestmark = [pytest.mark.skipif(kernel_unavailable() is not None, reason=f"paged kernel: {kernel_unavailable()}"),
              pytest.mark.usefixtures("cpu_isa")]


def padded(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (6, 6), (14, 2)])
def test_kernel_equals_attention_over_each_rows_own_context(dtype, heads):
    num_heads, num_kv_heads = heads
    lens = [1, 3, 16, 17, 40, 100, 5]  # one token, partial and exact blocks
    pool, tables, contexts = filled_pool(lens, num_kv_heads, 32, 16, dtype)
    q = torch.randn(len(lens), num_heads, 32)
    out, lse = decode_attention_paged(q, *pool.block_views(LAYER), padded(tables), torch.tensor(lens), 32**-0.5)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i], decode_attention_reference(q[i], k, v, 32**-0.5), atol=2e-5, rtol=1e-5)
        qg = q[i].view(num_kv_heads, -1, 32)[None]  # [1, KvH, G, D]
        _, want_lse = attention_with_lse_reference(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 32**-0.5)
        torch.testing.assert_close(lse[i], want_lse.reshape(num_heads), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_the_vectorised_head_sizes_agree_over_partial_tiles_and_any_block_size(dtype, head_dim, block_size):
    """64 and 128 take the kernel's 16-tokens-at-a-time scores pass: tiles cut short by a block's or the
    context's end (1, 15, 17, 33 tokens) and blocks smaller than a tile give the reference's scores."""
    lens = [1, 15, 16, 17, 33, 100, 250]
    pool, tables, contexts = filled_pool(lens, 2, head_dim, block_size, dtype, seed=5)
    q = torch.randn(len(lens), 14, head_dim)
    scale = head_dim**-0.5
    out, lse = decode_attention_paged(q, *pool.block_views(LAYER), padded(tables), torch.tensor(lens), scale)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i], decode_attention_reference(q[i], k, v, scale), atol=2e-5, rtol=1e-5)
        qg = q[i].view(2, -1, head_dim)[None]
        _, want_lse = attention_with_lse_reference(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
        torch.testing.assert_close(lse[i], want_lse.reshape(14), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_smaller_than_the_thread_count_splits_by_kv_head_with_the_same_result(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool, tables, contexts = filled_pool([70], 2, 64, 16, torch.float32, seed=3)
        q = torch.randn(1, 6, 64)
        out, _ = decode_attention_paged(q, *pool.block_views(LAYER), padded(tables), torch.tensor([70]), 0.125)
    finally:
        torch.set_num_threads(before)
    k, v = contexts[0]
    torch.testing.assert_close(out[0], decode_attention_reference(q[0], k, v, 0.125), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_in_place_equals_the_gathered_groups(dtype):
    """The same decode step through `paged_attention`, both ways: one in-place group vs sorted
    groups of 16 gathered rows (the reference)."""
    rng = random.Random(4)
    lens = [rng.randint(2, 90) for _ in range(37)]  # more rows than one reference group
    pool, tables, _ = filled_pool(lens, 2, 32, 8, dtype, seed=4)  # the last token is overwritten by the step's
    q, k, v = torch.randn(len(lens), 6, 32), torch.randn(len(lens), 2, 32), torch.randn(len(lens), 2, 32)
    slots = torch.tensor([t[(n - 1) // 8] * 8 + (n - 1) % 8 for t, n in zip(tables, lens)])

    def run(in_place: bool, group_rows: int) -> torch.Tensor:
        groups = decode_groups(list(range(len(lens))), tables, lens,
                                            lambda values: torch.tensor(values, dtype=torch.long), group_rows)
        meta = AttentionMetadata(slots, [], None, groups, backend=PAGED_DECODE if in_place else REFERENCE)
        return paged_attention(q, k, v, pool, LAYER, meta, 32**-0.5)

    torch.testing.assert_close(run(True, 1 << 30), run(False, 16), atol=2e-5, rtol=1e-5)


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("paged") / "m", "qwen3")


def engine(path, attention: str, dtype: str = "fp32", cascade: bool = True, num_blocks: int = 192,
           kv_dtype: str = "auto", **scheduler):
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype, "attention": attention,
                                                   "cascade_attention": cascade},
                                         "kv_pool": {"num_blocks": num_blocks, "kv_dtype": kv_dtype},
                                         "scheduler": scheduler})
    return LLM(config=config)


def test_auto_picks_the_kernel_on_a_float_pool_and_torch_keeps_the_reference(tiny):
    assert engine(tiny, "auto").engine.runner.attention.decode_in_place
    assert not engine(tiny, "torch").engine.runner.attention.decode_in_place


def test_auto_picks_the_int8_kernel_on_an_int8_pool(tiny):
    llm = engine(tiny, "auto", num_blocks=64, kv_dtype="int8")
    assert llm.engine.runner.attention.decode_in_place and llm.engine.runner.pool.supports_int8_block_views


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int4"])
def test_auto_falls_back_to_torch_on_a_pool_the_kernels_cannot_read(tiny, kv_dtype):
    assert not engine(tiny, "auto", num_blocks=64, kv_dtype=kv_dtype).engine.runner.attention.decode_in_place


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int4"])
def test_paged_on_a_pool_the_kernels_cannot_read_is_a_config_error(tiny, kv_dtype):
    from sage_infer.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^model.attention: paged: kv_dtype {kv_dtype} is quantized"):
        engine(tiny, "paged", num_blocks=64, kv_dtype=kv_dtype)


@pytest.mark.parametrize("cascade", [False, True])
def test_int8_pool_greedy_tokens_agree_between_the_int8_kernel_and_the_torch_path(tiny, cascade):
    """Both paths attend in fp32 over the same int8 codes and scales (the kernel folds the scales into scores and
    probabilities, the torch path dequantizes first): only rounding differs, as between bf16 paths."""
    rng = random.Random(4)
    system = [rng.randrange(5, 500) for _ in range(41 * 16 + 3)] if cascade else []
    lens = [rng.randint(1, 40) for _ in range(16)] if cascade else [1, 7, 16, 33, 64, 90, 150, 12]
    prompts = [system + [rng.randrange(5, 500) for _ in range(n)] for n in lens]
    kernel = engine(tiny, "paged", kv_dtype="int8", cascade=cascade)
    got = greedy_tokens(kernel, prompts, 12)
    assert_within_bf16_drift(got, greedy_tokens(engine(tiny, "torch", kv_dtype="int8", cascade=cascade), prompts, 12))
    kernel.engine.kv.block_manager.check_invariants()
    assert not cascade or kernel.engine.runner.cascade_steps > 0


def test_fp32_greedy_tokens_are_identical_with_the_kernel_and_the_reference(tiny):
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 7, 16, 33, 64, 90, 150, 12)]
    assert greedy_tokens(engine(tiny, "paged"), prompts, 12) == greedy_tokens(engine(tiny, "torch"), prompts, 12)


def test_fp32_greedy_tokens_are_identical_under_preemption_and_chunked_prefill(tiny):
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (30, 35, 40, 25, 38, 33)]
    small = dict(num_blocks=8, max_num_seqs=6, max_num_batched_tokens=32)
    paged, torch_ = engine(tiny, "paged", **small), engine(tiny, "torch", **small)
    assert greedy_tokens(paged, prompts, 12) == greedy_tokens(torch_, prompts, 12)
    paged.engine.kv.block_manager.check_invariants()


def test_fp32_greedy_tokens_are_identical_with_cascade_over_a_shared_prefix(tiny):
    rng = random.Random(2)
    system = [rng.randrange(5, 500) for _ in range(41 * 16 + 3)]  # 41 shared blocks: past the fp32 break-even
    prompts = [system + [rng.randrange(5, 500) for _ in range(rng.randint(1, 40))] for _ in range(16)]
    paged = engine(tiny, "paged")
    assert greedy_tokens(paged, prompts, 8) == greedy_tokens(engine(tiny, "torch", cascade=False), prompts, 8)
    assert paged.engine.runner.cascade_steps > 0


def test_bf16_greedy_tokens_agree_with_the_reference_within_drift(tiny):
    """bf16: both paths attend in fp32 over the same bf16 K/V, only the summation order differs;
    allowed: a sequence may diverge after its first 4 tokens (rounding near a tie), at most 1 in 4."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 20, 40, 64, 100, 130, 8, 50)]
    got = greedy_tokens(engine(tiny, "paged", dtype="bf16"), prompts, 12)
    want = greedy_tokens(engine(tiny, "torch", dtype="bf16"), prompts, 12)
    assert_within_bf16_drift(got, want)


# -- short chunks after cached context as in-place rows ----------------------------------------


def chunk_step(plan, shared_blocks: int = 0, block_size: int = 4, heads=(6, 2), head_dim=16, seed=7,
               dtype=torch.float32):
    """A pool and sequences for one step: `plan` = [(cached tokens, new tokens)]; the first
    `shared_blocks` blocks are one table prefix of every sequence with cached tokens past it."""
    from sage_infer.core.sampling_params import SamplingParams as Params
    from sage_infer.core.sequence import Sequence

    torch.manual_seed(seed)
    num_heads, num_kv_heads = heads
    pool = KVPool(KVCacheSchema(LAYERS, num_kv_heads, head_dim, block_size, KVDtype.FP32), 256, dtype=dtype)
    free = list(range(shared_blocks, 256))
    random.Random(seed).shuffle(free)
    prefix = list(range(shared_blocks))
    seqs, stored = [], set()
    for i, (cached, new) in enumerate(plan):
        total = cached + new
        table = list(prefix) if cached >= shared_blocks * block_size > 0 else []
        table += [free.pop() for _ in range(-(-total // block_size) - len(table))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached)]
        fresh = [s for s in slots if s not in stored]
        stored.update(fresh)
        if fresh:
            pool.store(LAYER, torch.randn(len(fresh), num_kv_heads, head_dim),
                       torch.randn(len(fresh), num_kv_heads, head_dim), torch.tensor(fresh))
        seq = Sequence(i, f"r{i}", 0, list(range(total)), total, Params(), b"")
        seq.block_table, seq.num_computed_tokens = table, cached
        seqs.append(seq)
    t = sum(n for _, n in plan)
    q, k, v = torch.randn(t, num_heads, head_dim), torch.randn(t, num_kv_heads, head_dim), torch.randn(
        t, num_kv_heads, head_dim)
    return pool, seqs, [n for _, n in plan], q.to(dtype), k.to(dtype), v.to(dtype)


def test_a_short_chunk_after_cached_context_becomes_causal_in_place_rows():
    plan = [(100, 5), (37, 64), (40, 65), (0, 9), (20, 1)]  # 5 and 64 in place; 65 and a first chunk are spans
    pool, seqs, num_new, *_ = chunk_step(plan)
    _, meta = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=False,
                          attention=PAGED_DECODE).prepare(seqs, num_new)
    (group,) = meta.decode_groups
    assert group.context_lens.tolist() == list(range(101, 106)) + list(range(38, 102)) + [21]
    assert group.rows.tolist() == list(range(5 + 64)) + [sum(num_new) - 1]
    assert [(s.q_len, s.context_len) for s in meta.prefills] == [(65, 105), (9, 9)]
    _, reference = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=False).prepare(
        seqs, num_new)
    assert [s.q_len for s in reference.prefills] == [5, 64, 65, 9]  # without the kernel: spans as before


@pytest.mark.skipif(flash_unavailable(64, torch.float32) is not None, reason="the fp32 flash kernel cannot run here")
def test_with_the_flash_prefill_a_chunk_over_many_keys_is_a_span_and_attends_the_same(monkeypatch):
    """Above `IN_PLACE_CHUNK_PAIRS` (rows x context; made small here) a short chunk of more than `IN_PLACE_MIN_ROWS`
    rows after cached context is a flash span, not decode rows; below either, and with the reference prefill part,
    decode rows as before."""
    monkeypatch.setattr(base, "IN_PLACE_CHUNK_PAIRS", 1000)
    monkeypatch.setattr(base, "IN_PLACE_MIN_ROWS", 6)
    plan = [(300, 5), (60, 16), (150, 8), (20, 1)]  # 5 rows (5 x 305 pairs), 1 x 21: rows; 16 x 76, 8 x 158: spans
    pool, seqs, num_new, q, k, v = chunk_step(plan, heads=(6, 2), head_dim=64)
    flash = attention_backend(decode="paged", prefill="flash")
    _, meta = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=False, attention=flash).prepare(
        seqs, num_new)
    (group,) = meta.decode_groups
    assert group.context_lens.tolist() == list(range(301, 306)) + [21]
    assert [(s.q_len, s.context_len) for s in meta.prefills] == [(16, 76), (8, 158)]
    _, rows = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=False, attention=PAGED_DECODE).prepare(
        seqs, num_new)
    assert not rows.prefills  # the reference prefill part: every chunk here is decode rows
    got = paged_attention(q, k, v, pool, LAYER, meta, 0.125)
    want = paged_attention(q, k, v, pool, LAYER, rows, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cascade", [False, True])
def test_in_place_chunks_attend_what_the_gathered_spans_attend(cascade):
    # 8 sequences past a 6-block shared prefix: decode rows and chunks of 2-40 tokens; one 70-token chunk
    plan = [(24 + c, n) for c, n in ((0, 1), (3, 7), (5, 40), (1, 2), (9, 1), (2, 70), (4, 13), (0, 1))]
    pool, seqs, num_new, q, k, v = chunk_step(plan, shared_blocks=6)
    runner = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=cascade, attention=PAGED_DECODE)
    runner.cascade_min_saved_tokens = 1
    _, meta = runner.prepare(seqs, num_new)
    assert (meta.shared is not None) == cascade
    _, reference = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=False).prepare(
        seqs, num_new)
    got = paged_attention(q, k, v, pool, LAYER, meta, 0.25)
    want = paged_attention(q, k, v, pool, LAYER, reference, 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_fp32_greedy_tokens_are_identical_for_a_follow_up_turn_over_the_cached_conversation(tiny):
    rng = random.Random(4)
    first = [[rng.randrange(5, 500) for _ in range(n)] for n in (40, 90, 17)]
    paged, reference = engine(tiny, "paged"), engine(tiny, "torch")
    replies = greedy_tokens(paged, first, 8)
    assert replies == greedy_tokens(reference, first, 8)
    turns = [p + r + [rng.randrange(5, 500) for _ in range(n)] for p, r, n in zip(first, replies, (3, 30, 60))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got, want = paged.generate(turns, params), reference.generate(turns, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # each turn's cached whole blocks were read back; only its short tail was computed (in place)
    # (the last reply token has no K/V yet: it was sampled, never fed)
    assert [o.metrics.num_cached_tokens for o in got] == [(len(p + r) - 1) // 16 * 16 for p, r in zip(first, replies)]
