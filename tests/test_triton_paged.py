"""The Triton paged kernels (read pool blocks in place on an NVIDIA GPU), decode and prefill, agree with the
pure-PyTorch oracle: per call against attention over each row's (each span's) own context, through
`paged_attention` against the gathered groups and spans, and, on a GPU, end to end as the engine's greedy
tokens against its torch path and against transformers on the same device.

Without a GPU the kernel code runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported): the same kernel source, slowly. The engine tests need a
CUDA device and say so when they skip."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.layers.attention import (
    AttentionMetadata,
    attention_with_lse_reference,
    decode_attention_reference,
    decode_groups,
    paged_attention,
    prefill_attention,
)
from sage_infer.layers.attention_backends import PAGED_DECODE, REFERENCE, attention_backend
from sage_infer.layers.triton_paged import (
    PREFILL_ROWS,
    decode_attention,
    interpreting,
    num_splits,
    prefill_tiles,
    triton,
)
from sage_infer.layers.triton_paged import prefill_attention as prefill_attention_paged
from tests import kv_fill
from tests.kv_fill import LAYER
from tests.tiny_models import greedy_tokens
from tests.triton_variants import compiled_variants

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    triton is None or not (CUDA or interpreting()),
    reason="triton is not installed" if triton is None else "no CUDA GPU and TRITON_INTERPRET is not 1")
needs_gpu = pytest.mark.skipif(not CUDA, reason="the engine on a CUDA device needs a CUDA GPU")
TOKENS = 16  # greedy tokens per prompt in the engine tests

# bf16/fp16: the probabilities are rounded to the value dtype before P.V (as flash attention does), so the
# output is within a few 1e-3 of fp32 attention over the same stored K/V; the log-sum-exp is not rounded
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.5e-2, rtol=1e-2),
             torch.float16: dict(atol=3e-3, rtol=1e-3)}


HEADS = [(8, 2, 32), (14, 2, 64), (6, 6, 16), (4, 1, 128)]  # (query heads, KV heads, head_dim)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the prefill kernel over every dtype x head shape on a GPU; under the interpreter (minutes for the product) each
# head shape once and each dtype at least once: the kernel's code paths are per dtype and per head_dim
DTYPES_BY_HEADS = ([(d, h) for d in DTYPES for h in HEADS] if CUDA
                   else [(DTYPES[i % len(DTYPES)], h) for i, h in enumerate(HEADS)])


def filled_pool(lens, num_kv_heads, head_dim, block_size, dtype, seed=0):
    return kv_fill.filled_pool(lens, num_kv_heads, head_dim, block_size, dtype, seed, DEVICE)


def padded(tables, extra: int = 0):
    width = max(map(len, tables)) + extra
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


def check_against_reference(q, out, lse, contexts, num_kv_heads, dtype, scale):
    head_dim = q.shape[-1]
    for i, (k, v) in enumerate(contexts):
        qi = q[i].float().cpu()
        torch.testing.assert_close(out[i].cpu(), decode_attention_reference(qi, k, v, scale), **TOLERANCE[dtype])
        qg = qi.view(num_kv_heads, -1, head_dim)[None]  # [1, KvH, G, D]
        _, want_lse = attention_with_lse_reference(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
        torch.testing.assert_close(lse[i].cpu(), want_lse.reshape(-1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2, 32), (14, 2, 64), (6, 6, 16), (4, 1, 128)])
def test_kernel_equals_attention_over_each_rows_own_context(dtype, heads):
    num_heads, num_kv_heads, head_dim = heads
    lens = [1, 3, 16, 17, 64, 65, 130]  # one token, partial and exact blocks, exact and partial tiles
    pool, tables, contexts = filled_pool(lens, num_kv_heads, head_dim, 16, dtype)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype).to(DEVICE)
    out, lse = decode_attention(q, *pool.block_views(LAYER), padded(tables), torch.tensor(lens, device=DEVICE),
                                head_dim**-0.5)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    check_against_reference(q, out, lse, contexts, num_kv_heads, dtype, head_dim**-0.5)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_fp32_queries_over_a_16_bit_pool_are_not_rounded(pool_dtype):
    """An fp32 model over a bf16/fp16 pool: the stored keys and values are widened, the queries kept fp32 and
    the probabilities unrounded, so the result is fp32 attention over the stored K/V."""
    lens = [1, 30, 100]
    pool, tables, contexts = filled_pool(lens, 2, 32, 16, pool_dtype)
    q = torch.randn(len(lens), 8, 32, device=DEVICE)
    out, lse = decode_attention(q, *pool.block_views(LAYER), padded(tables), torch.tensor(lens, device=DEVICE), 0.2)
    check_against_reference(q, out, lse, contexts, 2, torch.float32, 0.2)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_splitting_the_context_gives_the_same_result(splits, block_size):
    """Rows shorter than the splits' reach (a split past the context sees nothing) and rows that span
    every split; block tables wider than any row; pool blocks smaller and larger than a tile."""
    lens = [1, 40, 200, 333, 64]
    pool, tables, contexts = filled_pool(lens, 2, 32, block_size, torch.float32, seed=splits)
    q = torch.randn(len(lens), 8, 32, device=DEVICE)
    out, lse = decode_attention(q, *pool.block_views(LAYER), padded(tables, extra=2),
                                torch.tensor(lens, device=DEVICE), 0.2, splits=splits)
    check_against_reference(q, out, lse, contexts, 2, torch.float32, 0.2)


def test_split_choice_fills_the_gpu_without_empty_or_tiny_splits():
    # batch 1 over 384 tokens on 132 multiprocessors: one split per 64-token tile
    assert num_splits(1, 2, 384, 132) == (6, 1)
    # 64 rows x 2 KV heads already give 128 programs: 1,100 tokens (18 tiles) cut in 5 of at most 4 tiles
    assert num_splits(64, 2, 1100, 132) == (5, 4)
    # enough programs without splitting; a context of one tile never splits
    assert num_splits(512, 8, 4096, 132) == (1, 64)
    assert num_splits(1, 1, 10, 132) == (1, 1)
    splits, per_split = num_splits(1, 1, 1 << 20, 132)
    assert splits <= 64 and splits * per_split * 64 >= 1 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_in_place_equals_the_gathered_groups(dtype):
    """One decode step through `paged_attention` both ways on the device: the Triton kernel in place against
    sorted groups of 16 gathered rows (the reference)."""
    rng = random.Random(4)
    lens = [rng.randint(2, 90) for _ in range(37)]
    pool, tables, _ = filled_pool(lens, 2, 32, 8, dtype, seed=4)  # the last token is overwritten by the step's
    q, k, v = (torch.randn(len(lens), h, 32).to(dtype).to(DEVICE) for h in (6, 2, 2))
    slots = torch.tensor([t[(n - 1) // 8] * 8 + (n - 1) % 8 for t, n in zip(tables, lens)], device=DEVICE)

    def run(in_place: bool, group_rows: int) -> torch.Tensor:
        groups = decode_groups(list(range(len(lens))), tables, lens,
                                            lambda values: torch.tensor(values, dtype=torch.long, device=DEVICE),
                                            group_rows)
        meta = AttentionMetadata(slots, [], None, groups, backend=PAGED_DECODE if in_place else REFERENCE)
        return paged_attention(q, k, v, pool, LAYER, meta, 32**-0.5).float()

    torch.testing.assert_close(run(True, 1 << 30), run(False, 16), **TOLERANCE[dtype])


def test_cpu_tensors_outside_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pool, tables, _ = filled_pool([5], 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="CPU tensors only under TRITON_INTERPRET=1"):
        decode_attention(torch.randn(1, 4, 32), *(b.cpu() for b in pool.block_views(LAYER)),
                         padded(tables).cpu(), torch.tensor([5]), 1.0)


def test_where_the_kernel_cannot_run_paged_is_a_config_error_and_auto_falls_back():
    from sage_infer.engine.build import use_paged_attention
    from sage_infer.errors import ConfigError
    from sage_infer.layers.triton_paged import triton_unavailable

    pool, _, _ = filled_pool([5], 2, 32, 16, torch.float32)
    assert "runs on NVIDIA CUDA devices (device is xpu)" in triton_unavailable(torch.device("xpu"))
    with pytest.raises(ConfigError, match="^model.attention: paged: the kernel runs on CPUs .* device is xpu"):
        use_paged_attention("paged", pool, torch.device("xpu"))
    assert not use_paged_attention("auto", pool, torch.device("xpu"))
    if not CUDA:  # this torch has no GPU: a CUDA device is refused with the reason
        assert triton_unavailable(torch.device("cuda")) is not None
        with pytest.raises(ConfigError, match="^model.attention: paged: "):
            use_paged_attention("paged", pool, torch.device("cuda"))


def test_where_the_prefill_kernels_cannot_run_sage_is_a_config_error_and_auto_falls_back():
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, ScaleLayout
    from sage_infer.engine.build import use_flash_attention
    from sage_infer.errors import ConfigError
    from sage_infer.kv_runtime import make_kv_pool

    model, float_pool = torch.nn.Linear(4, 4), filled_pool([5], 2, 32, 16, torch.float32)[0]
    with pytest.raises(ConfigError, match=r"^model.prefill_attention: sage: the kernels run on CPUs \(C\+\+\) and "
                                          r"NVIDIA GPUs \(Triton\); device is xpu"):
        use_flash_attention("sage", model, 32, torch.device("xpu"), float_pool)
    assert not use_flash_attention("auto", model, 32, torch.device("xpu"), float_pool)
    assert not use_flash_attention("torch", model, 32, torch.device("cuda"), float_pool)
    int8_pool = make_kv_pool(KVCacheSchema(2, 2, 32, 16, KVDtype.INT8, scale_layout=ScaleLayout.PER_TOKEN), 4,
                             device=DEVICE)
    if CUDA:  # the kernel reads float blocks: an int8 pool is refused, auto falls back
        with pytest.raises(ConfigError, match="^model.prefill_attention: sage: kv_dtype int8 is quantized"):
            use_flash_attention("sage", model.cuda(), 32, torch.device("cuda"), int8_pool)
        assert not use_flash_attention("auto", model.cuda(), 32, torch.device("cuda"), int8_pool)
        assert use_flash_attention("auto", model.cuda(), 32, torch.device("cuda"), float_pool)
    else:
        with pytest.raises(ConfigError, match="^model.prefill_attention: sage: "):
            use_flash_attention("sage", model, 32, torch.device("cuda"), int8_pool)
        assert not use_flash_attention("auto", model, 32, torch.device("cuda"), float_pool)


# -- the prefill kernel ------------------------------------------------------------------------------------


def run_prefill(q, pool, tables, spans, scale, out=None):
    out = torch.full_like(q, float("nan")) if out is None else out
    tiles = torch.tensor(prefill_tiles(spans), dtype=torch.int32, device=DEVICE)
    prefill_attention_paged(q, *pool.block_views(LAYER), out, padded(tables),
                            torch.tensor(spans, dtype=torch.int32, device=DEVICE), tiles, scale)
    return out


def spans_of(shapes):
    """(first row, queries, context) of spans with these (queries, context) shapes, laid out back to back."""
    firsts = [sum(q for q, _ in shapes[:i]) for i in range(len(shapes))]
    return [(first, q, c) for first, (q, c) in zip(firsts, shapes)]


@pytest.mark.parametrize(("dtype", "heads"), DTYPES_BY_HEADS)
def test_prefill_kernel_equals_causal_attention_over_each_spans_context(dtype, heads):
    """Whole prompts and chunks after cached context; spans of one query, of exact and partial tiles of
    queries and of keys; the mask aligned to the lower-right corner."""
    num_heads, num_kv_heads, head_dim = heads
    shapes = [(1, 1), (5, 5), (64, 64), (65, 65), (1, 40), (70, 130), (130, 200), (16, 300)]
    pool, tables, contexts = filled_pool([c for _, c in shapes], num_kv_heads, head_dim, 16, dtype)
    spans = spans_of(shapes)
    q = torch.randn(sum(q for q, _ in shapes), num_heads, head_dim).to(dtype).to(DEVICE)
    out = run_prefill(q, pool, tables, spans, head_dim**-0.5)
    assert out.dtype == dtype
    for (first, n, _), (k, v) in zip(spans, contexts):
        want = prefill_attention(q[first : first + n].float().cpu(), k, v, head_dim**-0.5)
        torch.testing.assert_close(out[first : first + n].float().cpu(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_prefill_kernel_reads_any_block_size_and_leaves_other_rows_alone(block_size):
    """Pool blocks smaller and larger than a tile, tables wider than a span's context, spans that are not
    back to back: rows between them (decode rows of the step) keep what `out` held."""
    shapes = [(3, 90), (100, 100), (33, 257)]
    pool, tables, contexts = filled_pool([c for _, c in shapes], 2, 32, block_size, torch.float32, seed=block_size)
    spans = [(2, 3, 90), (9, 100, 100), (115, 33, 257)]
    q = torch.randn(150, 8, 32, device=DEVICE)
    out = run_prefill(q, pool, [t + [0, 0] for t in tables], spans, 0.2, out=torch.zeros_like(q))
    touched = torch.zeros(150, dtype=torch.bool)
    for (first, n, _), (k, v) in zip(spans, contexts):
        touched[first : first + n] = True
        want = prefill_attention(q[first : first + n].cpu(), k, v, 0.2)
        torch.testing.assert_close(out[first : first + n].cpu(), want, **TOLERANCE[torch.float32])
    assert not out.cpu()[~touched].any()


def test_prefill_tiles_cover_every_query_once_longest_context_first():
    spans = [(0, 1, 1), (1, 130, 200), (131, 64, 64), (195, 65, 300)]
    tiles = prefill_tiles(spans)
    covered = sorted((span, m + r) for span, m in tiles for r in range(PREFILL_ROWS) if m + r < spans[span][1])
    assert covered == [(i, m) for i, (_, n, _) in enumerate(spans) for m in range(n)]
    assert [span for span, _ in tiles] == [3, 3, 1, 1, 1, 2, 0]
    assert tiles[:2] == [(3, 64), (3, 0)]  # within a span, the tile whose queries see the most keys first


@needs_gpu
def test_tables_of_any_width_and_any_split_reuse_one_compiled_kernel():
    """Block tables 1 to 40 blocks wide, 1 to 5 splits of 1 to 4 tiles: the integers that vary between steps are
    not specialized on (Triton compiles anew for an integer that turns 1 or a multiple of 16), so a request of a new
    length never waits for a compile while serving."""
    from sage_infer.layers.triton_paged import _kernels

    partial, merge, prefill = _kernels()
    counts, pads = [], set()
    merged_before = compiled_variants(merge)
    for blocks, splits in [(1, 1), (2, 1), (16, 3), (17, 7), (40, 3), (16, 1)]:
        lens = [blocks * 16 - 3, blocks * 16]
        used, per_split = num_splits(2, 2, blocks * 16, 1, splits)  # (the multiprocessors count only unwanted)
        pads |= {triton.next_power_of_2(used)} if used > 1 else set()
        pool, tables, _ = filled_pool(lens, 2, 32, 16, torch.bfloat16, seed=blocks)
        q = torch.randn(len(lens), 8, 32, device=DEVICE).to(torch.bfloat16)
        decode_attention(q, *pool.block_views(LAYER), padded(tables), torch.tensor(lens, device=DEVICE), 0.2,
                         splits=splits)
        run_prefill(torch.randn(lens[0], 8, 32, device=DEVICE).to(torch.bfloat16), pool, tables[:1],
                    [(0, lens[0], lens[0])], 0.2)
        torch.cuda.synchronize()
        counts.append((compiled_variants(partial), compiled_variants(merge), compiled_variants(prefill), len(pads),
                       per_split))
    # (earlier tests may have compiled these shapes already: counted from the first call on) the decode and
    # prefill kernels compile at most once; the merge kernel at most once per power-of-two padding of the splits
    # (a constexpr)
    assert len({c[0] for c in counts}) == 1 and len({c[2] for c in counts}) == 1, counts
    assert counts[-1][1] - merged_before <= len(pads) and len(pads) == 3, counts
    assert len({c[4] for c in counts}) == 3, counts  # tiles per split 1, 2 and 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_with_the_prefill_kernel_equals_span_by_span(dtype):
    """A mixed step through `ModelRunner.prepare` and `paged_attention` on the device: prompts, chunks after
    cached context (longer than `IN_PLACE_CHUNK_ROWS`: spans; shorter: decode rows) and decode rows; the
    prefill kernel in place against the gathered spans (the reference), the decode rows alike in both."""
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.kv_runtime import KVPool
    from tests.kv_fill import LAYERS

    torch.manual_seed(7)
    block_size, shapes = 8, [(0, 37), (0, 5), (40, 100), (60, 1), (13, 70), (20, 10)]  # (cached, new tokens)
    pool = KVPool(KVCacheSchema(LAYERS, 2, 32, block_size, KVDtype.FP32), 64, dtype=dtype, device=DEVICE)
    seqs, free = [], list(range(64))
    for cached, new in shapes:
        tokens = list(range(1, cached + new + 1))
        seq = Sequence(len(seqs), f"r{len(seqs)}", 0, tokens, len(tokens), SamplingParams(), b"")
        seq.block_table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        seq.num_computed_tokens = cached
        seqs.append(seq)
        if cached:  # the cached context, as earlier steps stored it
            table = seq.block_table
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(cached)])
            pool.store(LAYER, *(torch.randn(cached, 2, 32).to(dtype).to(DEVICE) for _ in "kv"), slots.to(DEVICE))
    news = [new for _, new in shapes]
    q, k, v = (torch.randn(sum(news), h, 32).to(dtype).to(DEVICE) for h in (6, 2, 2))

    def run(prefill_in_place: bool) -> torch.Tensor:
        runner = ModelRunner(None, pool, DEVICE, attention=attention_backend(
            decode="paged", prefill="triton" if prefill_in_place else "torch"))
        _, meta = runner.prepare(seqs, news)
        # the Triton part's context is its block tables and tiles; the torch part's the gathered slots
        assert isinstance(meta.prefill_context, torch.Tensor) != prefill_in_place
        assert len(meta.prefills) == (5 if prefill_in_place else 4)  # the short chunk: a span, or decode rows
        return paged_attention(q, k, v, pool, LAYER, meta, 32**-0.5).float()

    torch.testing.assert_close(run(True), run(False), **TOLERANCE[dtype])


# -- the engine on a CUDA device ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("triton") / "m", "qwen3", num_hidden_layers=3)


def gpu_llm(path, attention: str, dtype: str = "fp32", scheduler: dict | None = None, **model):
    """`attention` torch: the reference path for prefill too, unless `model` says otherwise."""
    from sage_infer import LLM
    from sage_infer.config.serve import ServeConfig

    if attention == "torch":
        model = {"prefill_attention": "torch", **model}
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype, "attention": attention, **model},
                                         "kv_pool": {"num_blocks": 256}, "scheduler": scheduler or {}})
    return LLM(config=config, device="cuda")


def prompts(seed: int = 0, system_tokens: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 500) for _ in range(system_tokens)]  # a shared prefix (prefix-cache hits)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 17, 40, 130, 300)] + \
        [system + [rng.randrange(5, 500) for _ in range(n)] for n in (5, 9, 33, 70)]


@needs_gpu
def test_auto_picks_the_triton_kernels_on_a_gpu_and_torch_keeps_the_reference(tiny):
    runner = gpu_llm(tiny, "auto").engine.runner
    attention = runner.attention
    assert attention.decode_in_place and attention.prefill_in_place and not attention.prefill.flash
    assert not runner.cascade_attention  # each row reads its shared prefix in place
    runner = gpu_llm(tiny, "torch").engine.runner
    assert runner.attention == REFERENCE and runner.cascade_attention


@needs_gpu
@pytest.mark.parametrize("prefill_attention", ["sage", "torch"])
def test_engine_greedy_tokens_with_either_prefill_path_equal_the_reference_fp32(tiny, prefill_attention):
    """The prefill kernel alone (decode rows by PyTorch) and the decode kernel alone, against the torch path;
    a prompt longer than the 256-token step budget, so its later chunks read earlier ones from the pool."""
    batch = prompts(3) + [[(7 * i) % 400 + 5 for i in range(700)]]
    want = greedy_tokens(gpu_llm(tiny, "torch"), batch, TOKENS)
    attention = "torch" if prefill_attention == "sage" else "paged"
    llm = gpu_llm(tiny, attention, prefill_attention=prefill_attention, scheduler={"max_num_batched_tokens": 256})
    assert llm.engine.runner.attention.prefill_in_place == (prefill_attention == "sage")
    assert greedy_tokens(llm, batch, TOKENS) == want
    llm.engine.kv.block_manager.check_invariants()


@needs_gpu
def test_engine_greedy_tokens_on_the_gpu_equal_the_torch_path_fp32(tiny):
    batch = prompts()
    paged = gpu_llm(tiny, "paged")
    assert paged.engine.runner.attention.decode_in_place
    assert greedy_tokens(paged, batch, TOKENS) == greedy_tokens(gpu_llm(tiny, "torch"), batch, TOKENS)
    paged.engine.kv.block_manager.check_invariants()


@needs_gpu
def test_engine_bf16_on_the_gpu_stays_within_rounding_of_the_torch_path(tiny):
    """Twice the same batch: the second time its 256-token system prompt is in the prefix cache. With the
    reference prefill path those are cascade steps (the shared prefix attended once, the rows' suffixes by
    the kernel; bf16's threshold is 384 saved key reads); with the prefill kernel every span reads it in
    place."""
    from tests.tiny_models import assert_within_bf16_drift

    batch = prompts(1, system_tokens=256)
    reference = gpu_llm(tiny, "torch", "bf16")
    want = greedy_tokens(reference, batch, TOKENS)
    for prefill in ("torch", "sage"):
        paged = gpu_llm(tiny, "paged", "bf16", prefill_attention=prefill)
        assert_within_bf16_drift(greedy_tokens(paged, batch, TOKENS), want)
        assert_within_bf16_drift(greedy_tokens(paged, batch, TOKENS), want)
        assert (paged.engine.runner.cascade_steps > 0) == (prefill == "torch")
        paged.engine.kv.block_manager.check_invariants()


@needs_gpu
def test_engine_on_the_gpu_equals_transformers_on_the_gpu(tiny):
    """fp32 greedy tokens against transformers' `generate` on the same GPU (TF32 off on both sides); a
    mismatch only at a near-tie of transformers' logits."""
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval().cuda()
    batch = prompts(2)
    got = greedy_tokens(gpu_llm(tiny, "paged"), batch, TOKENS)
    for prompt, tokens in zip(batch, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=2, output_scores=True, return_dict_in_generate=True)
        want, scores = out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]
        for pos, (a, b) in enumerate(zip(tokens, want)):
            if a != b:
                top2 = scores[pos].topk(2).values
                assert float(top2[0] - top2[1]) < 1e-4, f"token {pos} differs ({a} vs {b}) without a near-tie"
                break
