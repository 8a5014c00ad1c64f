"""Cascade attention: sequences of a step that share leading KV blocks attend to them once, together,
and give what the reference path (each sequence over its whole context) gives."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.core.sampling_params import SamplingParams as Params
from sage_infer.core.sequence import Sequence
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.engine.shared_prefix import MIN_SAVED_TOKENS, MIN_SHARED_BLOCKS, find_shared_prefix
from sage_infer.kv_runtime import KVPool
from sage_infer.layers.attention import (
    attention_with_lse,
    attention_with_lse_reference,
    merge_attention,
    paged_attention,
)
from tests.tiny_models import make_tiny_model

H, KVH, D, BS = 6, 2, 16, 4
LAYERS, LAYER = 2, 1
SHARED_BLOCKS = 5


def test_the_largest_group_with_the_same_first_block_shares_its_common_prefix():
    shared = list(range(10, 20))
    tables = [shared + [30], shared + [31, 32], shared[:7], [40, 41, 42, 43, 44], []]
    assert find_shared_prefix(tables) == ([0, 1, 2], 7)


def test_the_group_follows_its_majority_past_a_divergence_when_that_saves_more():
    head, tail = [1, 2, 3, 4], list(range(50, 70))
    tables = [head + tail, head + tail + [99], head + tail[:5], head + [7, 8]]
    # all four share 4 blocks (saves 3 * 4 reads); three share 9 (2 * 9); two share 24 (1 * 24)
    assert find_shared_prefix(tables) == ([0, 1], 24)


def test_no_shared_prefix_below_the_minimums():
    short = list(range(MIN_SHARED_BLOCKS - 1))
    assert find_shared_prefix([short + [9], short + [8]]) == ([], 0)  # too few shared blocks
    assert find_shared_prefix([list(range(40)), list(range(100, 140))]) == ([], 0)  # nothing shared
    assert find_shared_prefix([list(range(40))]) == ([], 0)  # one sequence
    tables = [list(range(10))] * 3  # 3 sequences share 10 blocks: attending them once saves 2 * 10 reads
    assert find_shared_prefix(tables, min_saved_blocks=20) == ([0, 1, 2], 10)
    assert find_shared_prefix(tables, min_saved_blocks=21) == ([], 0)


def test_flash_kernel_with_lse_matches_plain_ops():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, KVH, 12, D), torch.randn(3, KVH, 20, D), torch.randn(3, KVH, 20, D)
    mask = torch.arange(20)[None, None, None, :] < torch.tensor([20, 7, 13])[:, None, None, None]
    for m in (None, mask):
        out, lse = attention_with_lse(q, k, v, D**-0.5, m)
        ref_out, ref_lse = attention_with_lse_reference(q, k, v, D**-0.5, m)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    k, v = k[:, :, :12], v[:, :, :12]
    out, lse = attention_with_lse(q, k, v, D**-0.5, causal=True)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, D**-0.5, torch.ones(12, 12, dtype=torch.bool).tril())
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_merging_two_halves_by_lse_equals_attention_over_both():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, KVH, 9, D), torch.randn(1, KVH, 30, D), torch.randn(1, KVH, 30, D)
    a = attention_with_lse_reference(q, k[:, :, :17], v[:, :, :17], D**-0.5)
    b = attention_with_lse_reference(q, k[:, :, 17:], v[:, :, 17:], D**-0.5)
    whole, _ = attention_with_lse_reference(q, k, v, D**-0.5)
    torch.testing.assert_close(merge_attention(*a, *b), whole, atol=1e-5, rtol=1e-5)


# -- a step mixing participants and other sequences ---------------------------------------------


def _slots(table: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(start, end)], dtype=torch.long)


def _runner(pool: KVPool, cascade: bool = True) -> ModelRunner:
    """A runner that takes the cascade path for any shared prefix of `MIN_SHARED_BLOCKS`, however small."""
    runner = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=cascade)
    runner.cascade_min_saved_tokens = 0
    return runner


def _step(dtype: torch.dtype, seed: int = 0):
    """A pool holding one shared prefix and a step over sequences that use it or not.

    Returns (pool, seqs, num_new_tokens, q, k, v): each sequence's first `num_computed_tokens`
    tokens are in the pool; q, k, v are this step's, flattened in `seqs` order.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    pool = KVPool(KVCacheSchema(LAYERS, KVH, D, BS, KVDtype.FP32), 256, dtype=dtype)
    free = list(range(256))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(SHARED_BLOCKS)]
    p = SHARED_BLOCKS * BS
    pool.store(LAYER, torch.randn(p, KVH, D), torch.randn(p, KVH, D), _slots(prefix, 0, p))
    # (shares the prefix, tokens computed before the step, new tokens)
    plan = [
        (True, p + 9, 1),  # decode rows with suffixes of various lengths
        (True, p + 1, 1),
        (True, p, 1),  # the new token is the first after the prefix
        (True, p + 22, 1),
        (True, p, 7),  # a prefill chunk right after the prefix: its suffix is its own tokens
        (True, p + 6, 5),  # a later chunk: cached suffix tokens, then its queries
        (True, p + 3, 1),
        (False, 11, 1),  # others: their own decode row, a chunk over cached context, a first chunk
        (False, 14, 6),
        (False, 0, 9),
    ]
    seqs, num_new = [], []
    for i, (sharing, computed, n) in enumerate(plan):
        total = computed + n
        table = list(prefix) if sharing else []
        table += [free.pop() for _ in range(-(-total // BS) - len(table))]
        start = p if sharing else 0
        pool.store(LAYER, torch.randn(computed - start, KVH, D), torch.randn(computed - start, KVH, D),
                   _slots(table, start, computed))
        seq = Sequence(i, f"r{i}", 0, list(range(total)), total, Params(), b"")
        seq.block_table, seq.num_computed_tokens = table, computed
        seqs.append(seq)
        num_new.append(n)
    t = sum(num_new)
    q = torch.randn(t, H, D).to(dtype)
    return pool, seqs, num_new, q, torch.randn(t, KVH, D).to(dtype), torch.randn(t, KVH, D).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cascade_equals_the_reference_path_for_decode_rows_and_prefill_chunks(dtype, tol):
    pool, seqs, num_new, q, k, v = _step(dtype)
    _, cascade_meta = _runner(pool).prepare(seqs, num_new)
    _, plain_meta = _runner(pool, cascade=False).prepare(seqs, num_new)
    shared = cascade_meta.shared
    assert plain_meta.shared is None and shared is not None
    assert shared.num_tokens == SHARED_BLOCKS * BS and len(shared.block_ids) == SHARED_BLOCKS
    assert sorted(shared.rows.tolist()) == list(range(sum(num_new[:7])))  # the 7 sharing sequences' rows
    assert len(shared.prefills) == 2 and sum(len(g.rows) for g in shared.decode_groups) == 5
    assert len(cascade_meta.prefills) == 2 and sum(len(g.rows) for g in cascade_meta.decode_groups) == 1
    got = paged_attention(q, k, v, pool, LAYER, cascade_meta, D**-0.5)
    want = paged_attention(q, k, v, pool, LAYER, plain_meta, D**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _sharing(computed_and_new: list[tuple[int, int]], runner: ModelRunner | None = None) -> list[int]:
    """The shared block ids `prepare` picks for sequences with one table [0..7] and these positions."""
    pool = KVPool(KVCacheSchema(LAYERS, KVH, D, BS, KVDtype.FP32), 64)
    runner = runner or _runner(pool)
    seqs = []
    for i, (computed, _) in enumerate(computed_and_new):
        seq = Sequence(i, f"r{i}", 0, list(range(8 * BS)), 8 * BS, Params(), b"")
        seq.block_table, seq.num_computed_tokens = list(range(8)), computed
        seqs.append(seq)
    _, meta = runner.prepare(seqs, [n for _, n in computed_and_new])
    return [] if meta.shared is None else meta.shared.block_ids.tolist()


def test_only_blocks_wholly_before_every_participants_first_query_are_shared():
    assert _sharing([(6 * BS, 1), (6 * BS + 2, 1)]) == list(range(6))  # not block 6, which holds a new token
    assert _sharing([(6 * BS, 1), (6 * BS + 2, 1), (5 * BS + 2, 3)]) == list(range(5))  # a chunk from block 5 on
    assert _sharing([(6 * BS, 1), (0, 5 * BS)]) == []  # a first chunk has no cached blocks


def test_the_break_even_depends_on_the_dtype_attention_runs_in():
    pool = KVPool(KVCacheSchema(LAYERS, KVH, D, BS, KVDtype.FP32), 64)
    fp32, bf16 = (ModelRunner(torch.nn.Linear(2, 2, dtype=dtype), pool, torch.device("cpu"))
                  for dtype in (torch.float32, torch.bfloat16))
    assert fp32.cascade_min_saved_tokens == MIN_SAVED_TOKENS[torch.float32] > bf16.cascade_min_saved_tokens
    two_decodes = [(6 * BS, 1), (6 * BS + 2, 1)]  # 6 shared blocks of 4 tokens: 24 key reads saved
    fp32.cascade_min_saved_tokens, bf16.cascade_min_saved_tokens = 25, 24
    assert _sharing(two_decodes, fp32) == [] and _sharing(two_decodes, bf16) == list(range(6))


# -- the engine ---------------------------------------------------------------------------------

BLOCK = 16
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cascade") / "m", "qwen3")


def engine(path, cascade: bool) -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": "fp32", "cascade_attention": cascade},
                                         "kv_pool": {"num_blocks": 192}})
    return LLM(config=config)


def test_the_engine_gives_the_same_greedy_tokens_with_cascade_on_or_off(tiny):
    rng = random.Random(0)
    system = [rng.randrange(5, 500) for _ in range(41 * BLOCK + 3)]  # 41 full shared blocks
    # 16 requests behind it: attending it once saves 15 * 41 * 16 key reads, past the fp32 break-even
    assert 15 * 41 * BLOCK >= MIN_SAVED_TOKENS[torch.float32]
    prompts = [system + [rng.randrange(5, 500) for _ in range(rng.randint(1, 40))] for _ in range(16)]
    prompts += [[rng.randrange(5, 500) for _ in range(n)] for n in (20, 70)]  # unrelated requests
    on, off = engine(tiny, True), engine(tiny, False)
    got = [o.outputs[0].token_ids for o in on.generate(prompts, GREEDY)]
    want = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY)]
    assert got == want
    assert on.engine.runner.cascade_steps >= GREEDY.max_tokens  # every decode step, at least
    assert off.engine.runner.cascade_steps == 0
    on.engine.kv.block_manager.check_invariants()
