"""`model.prefill_attention: sage`: the flash kernels (csrc/flash_bf16.cpp on AVX-512 and AVX512-BF16,
csrc/flash_avx2.cpp on AVX2; bf16 and fp32) against attention in fp32 plain ops, per call at every ISA level
this CPU runs (causal lower-right and unmasked, GQA, strided views, partial tiles, chunks long enough for tasks of
64 query positions and a partial last one), then in the engine against
PyTorch's flash kernel (the reference path): the same attention metadata through `paged_attention`, greedy
tokens within bf16 drift, and in fp32 the same greedy tokens. Skipped where no kernel can run (no AVX2, no
compiler): each test says why."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer import LLM
from sage_infer.config.serve import ServeConfig
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.errors import ConfigError
from sage_infer.hal.isa import ENV
from sage_infer.layers import cpu_kernels
from sage_infer.layers.attention import attention_with_lse_reference, paged_attention
from sage_infer.layers.attention_backends import attention_backend, flash_prefill
from sage_infer.layers.cpu_kernels import amx_flash_attention, flash_attention, flash_kernel, flash_unavailable
from tests.conftest import runnable_cpu_levels
from tests.test_paged_kernel import LAYER, chunk_step
from tests.tiny_models import assert_within_bf16_drift, greedy_tokens, make_tiny_model

WHY = flash_unavailable(64)  # at this CPU's own level: the engine tests
WHY_F32 = flash_unavailable(64, torch.float32)
needs_bf16 = pytest.mark.skipif(WHY is not None, reason=f"sage's bf16 flash kernel cannot run here: {WHY}")
needs_f32 = pytest.mark.skipif(WHY_F32 is not None, reason=f"sage's fp32 flash kernel cannot run here: {WHY_F32}")


@pytest.fixture
def bf16_kernel(cpu_isa) -> str:
    """The ISA level a per-call bf16 test runs at: each this CPU has (`conftest.cpu_isa`), skipped where that
    level's build has no bf16 kernel."""
    if why := flash_unavailable(64, torch.bfloat16):
        pytest.skip(f"no bf16 flash kernel at {cpu_isa}: {why}")
    return cpu_isa


@pytest.fixture
def f32_kernel(cpu_isa) -> str:
    """`bf16_kernel` for the fp32 tests."""
    if why := flash_unavailable(64, torch.float32):
        pytest.skip(f"no fp32 flash kernel at {cpu_isa}: {why}")
    return cpu_isa


def out_tolerance(dtype: torch.dtype) -> dict:
    """The AVX512-BF16 kernel rounds P to bf16 (as PyTorch's bf16 flash kernel does); the others keep it in fp32,
    so only the summation order differs from the reference."""
    if dtype == torch.bfloat16 and flash_kernel(dtype).endswith("AVX512-BF16"):
        return {"atol": 1e-2, "rtol": 0}
    return {"atol": 2e-6, "rtol": 1e-5}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """fp32 attention of q [Lq, H, D] over k, v [C, KvH, D]; causal aligned to the lower right."""
    lq, heads, _ = q.shape
    c, kv_heads, _ = k.shape
    groups = heads // kv_heads
    qh = q.float().transpose(0, 1).reshape(kv_heads, groups * lq, -1)[None]  # [1, KvH, G*Lq, D]
    kh, vh = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]
    mask = None
    if causal:
        visible = torch.arange(c)[None, :] <= torch.arange(lq)[:, None] + (c - lq)  # [Lq, C]
        mask = visible.repeat(groups, 1)[None, None]
    out, lse = attention_with_lse_reference(qh, kh, vh, scale, mask)
    return (out[0].view(kv_heads, groups, lq, -1).permute(2, 0, 1, 3).reshape(lq, heads, -1),
            lse[0].view(kv_heads, groups, lq).permute(2, 0, 1).reshape(lq, heads))


@pytest.mark.usefixtures("bf16_kernel")
@pytest.mark.parametrize("lq, c, causal", [(1, 1, True), (7, 7, True), (77, 77, True), (300, 300, True),
                                           (32, 1056, True), (5, 64, True), (64, 1024, False), (3, 70, False),
                                           (600, 1900, True), (257, 257, False)])
@pytest.mark.parametrize("heads, head_dim", [((14, 2), 64), ((4, 4), 32), ((8, 2), 128), ((4, 2), 96)])
def test_the_kernel_matches_fp32_attention(lq, c, causal, heads, head_dim):
    torch.manual_seed(lq * 31 + c)
    num_heads, num_kv_heads = heads
    q = torch.randn(lq, num_heads, head_dim).bfloat16()
    k, v = torch.randn(c, num_kv_heads, head_dim).bfloat16(), torch.randn(c, num_kv_heads, head_dim).bfloat16()
    out, lse = flash_attention(q, k, v, head_dim ** -0.5, causal)
    want, want_lse = reference(q, k, v, head_dim ** -0.5, causal)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == (lq, num_heads)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)  # scores: exact bf16 products, fp32 sums
    torch.testing.assert_close(out, want, **out_tolerance(torch.bfloat16))


@pytest.mark.usefixtures("f32_kernel")
@pytest.mark.parametrize("lq, c, causal", [(1, 1, True), (7, 7, True), (77, 77, True), (300, 300, True),
                                           (32, 1056, True), (5, 64, True), (64, 1024, False), (3, 70, False),
                                           (600, 1900, True), (257, 257, False)])
@pytest.mark.parametrize("heads, head_dim", [((14, 2), 64), ((6, 2), 64), ((4, 4), 32), ((8, 2), 128), ((4, 2), 96)])
def test_the_fp32_kernel_matches_fp32_attention(lq, c, causal, heads, head_dim):
    torch.manual_seed(lq * 17 + c)
    num_heads, num_kv_heads = heads
    q = torch.randn(lq, num_heads, head_dim)
    k, v = torch.randn(c, num_kv_heads, head_dim), torch.randn(c, num_kv_heads, head_dim)
    out, lse = flash_attention(q, k, v, head_dim ** -0.5, causal)
    want, want_lse = reference(q, k, v, head_dim ** -0.5, causal)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == (lq, num_heads)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)  # fp32 products: only the summation order differs


@pytest.mark.usefixtures("f32_kernel")
def test_fp32_strided_views_read_as_their_contiguous_copies():
    torch.manual_seed(1)
    qkv = torch.randn(90, (6 + 2 * 2) * 64)
    q, k, v = qkv[:, :384].view(90, 6, 64), qkv[:, 384:512].view(90, 2, 64), qkv[:, 512:].view(90, 2, 64)
    for causal in (True, False):
        got = flash_attention(q, k, v, 0.125, causal)
        want = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, causal)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.usefixtures("bf16_kernel")
def test_strided_views_read_as_their_contiguous_copies():
    """q, k, v as the engine has them: views into one fused qkv projection output."""
    torch.manual_seed(0)
    qkv = torch.randn(50, (6 + 2 * 2) * 64).bfloat16()
    q, k, v = qkv[:, :384].view(50, 6, 64), qkv[:, 384:512].view(50, 2, 64), qkv[:, 512:].view(50, 2, 64)
    got = flash_attention(q, k, v, 0.125, True)
    want = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif("avx2" not in runnable_cpu_levels(), reason="not an x86 CPU with AVX2: no avx2 build")
def test_the_avx2_build_runs_both_dtypes_on_its_fp32_kernel(monkeypatch):
    monkeypatch.setenv("SAGE_CPU_ISA", "avx2")
    assert flash_kernel(torch.float32) == "fp32 flash kernel on AVX2"
    assert flash_kernel(torch.bfloat16) == "fp32 flash kernel on AVX2, bf16 widened"
    assert flash_unavailable(32, torch.float32) is flash_unavailable(128, torch.bfloat16) is None


@pytest.mark.usefixtures("bf16_kernel")
def test_bad_shapes_are_clear_errors():
    q = torch.randn(4, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="causal needs at least as many keys as queries"):
        flash_attention(q, q[:2], q[:2], 0.1, True)
    with pytest.raises(RuntimeError, match="bf16 q, k and v"):
        flash_attention(q.half(), q.half(), q.half(), 0.1, False)
    with pytest.raises(RuntimeError, match="bf16 q, k and v"):
        flash_attention(q, q.float(), q.float(), 0.1, False)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        flash_attention(q[..., :48], q[..., :48], q[..., :48], 0.1, False)
    assert flash_unavailable(80) == "head_dim 80 is not a multiple of 32 up to 256"
    assert flash_unavailable(64, torch.float16) == "the kernel is bf16 or fp32 only (not torch.float16)"
    if flash_unavailable(64, torch.float32) is None:
        with pytest.raises(RuntimeError, match="float32 q, k and v"):
            flash_attention(q.float(), q, q, 0.1, False)
        with pytest.raises(RuntimeError, match="causal needs at least as many keys as queries"):
            flash_attention(q.float(), q[:2].float(), q[:2].float(), 0.1, True)


# -- the engine ---------------------------------------------------------------------------------


@needs_bf16
@pytest.mark.parametrize("part", ["flash", "flash_amx"])
@pytest.mark.parametrize("cascade", [False, True])
def test_paged_attention_with_the_kernel_matches_the_reference_path(cascade, part):
    """One bf16 step: first chunks, chunks after cached context and decode rows, with and without a shared
    prefix attended once (cascade): the kernel's spans and prefix against PyTorch's flash kernel (the AMX part
    runs PyTorch's kernel too, split as the torch part splits it, on any CPU)."""
    plan = [(24 + c, n) for c, n in ((0, 1), (3, 7), (5, 40), (1, 2), (2, 70), (0, 1))] + [(0, 33)]
    pool, seqs, num_new, q, k, v = chunk_step(plan, shared_blocks=6, heads=(8, 2), head_dim=64, dtype=torch.bfloat16)
    metas = []
    for flash in (True, False):
        runner = ModelRunner(None, pool, torch.device("cpu"), cascade_attention=cascade,
                             attention=attention_backend(prefill=part if flash else "torch"))
        runner.cascade_min_saved_tokens = 1
        metas.append(runner.prepare(seqs, num_new)[1])
    assert metas[0].backend.prefill.flash and not metas[1].backend.prefill.flash
    assert (metas[0].shared is not None) == cascade
    assert len(metas[0].prefills) + (len(metas[0].shared.prefills) if cascade else 0) >= 3
    got = paged_attention(q, k, v, pool, LAYER, metas[0], 0.125)
    want = paged_attention(q, k, v, pool, LAYER, metas[1], 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)  # both bf16, P rounded in both


def engine(path, prefill_attention: str, dtype: str = "bf16") -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(path), "dtype": dtype,
                                                   "prefill_attention": prefill_attention},
                                         "kv_pool": {"num_blocks": 96}})
    return LLM(config=config)


@needs_bf16
@pytest.mark.parametrize("forced", [False, True])
def test_bf16_greedy_tokens_agree_with_the_reference_within_drift(tmp_path, monkeypatch, forced):
    """`forced`: this CPU's own level named in SAGE_CPU_ISA, so sage's kernel runs even where the engine would take
    PyTorch's on AMX tiles (`amx_flash_attention`)."""
    if forced:
        monkeypatch.setenv(ENV, cpu_kernels._module().isa())
    path = make_tiny_model(tmp_path / "q3", "qwen3", head_dim=32)
    rng = random.Random(8)
    shared = [rng.randrange(5, 500) for _ in range(48)]  # a prefix cached after the first prompt
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 20, 40, 64, 100, 130)]
    prompts += [shared + [rng.randrange(5, 500) for _ in range(n)] for n in (3, 9)]
    got = greedy_tokens(engine(path, "sage"), prompts)
    want = greedy_tokens(engine(path, "torch"), prompts)
    assert_within_bf16_drift(got, want)


@needs_f32
def test_fp32_greedy_tokens_equal_the_reference_path(tmp_path):
    """fp32: the kernel's products are exact, so the tokens are the reference path's (PyTorch's flash kernel),
    prompts long enough for several 64-key tiles and a prefix cached by the first prompt."""
    path = make_tiny_model(tmp_path / "q3", "qwen3", head_dim=32)
    rng = random.Random(9)
    shared = [rng.randrange(5, 500) for _ in range(80)]
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 40, 130, 300)]
    prompts += [shared + [rng.randrange(5, 500) for _ in range(n)] for n in (3, 9, 70)]
    assert greedy_tokens(engine(path, "sage", "fp32"), prompts) == greedy_tokens(engine(path, "torch", "fp32"), prompts)


@needs_bf16
@pytest.mark.parametrize("forced", [False, True])
def test_the_setting_decides_which_kernel_runs(tmp_path, monkeypatch, forced):
    """sage's kernel, or on a CPU with AMX tiles PyTorch's through the AMX part (not with a forced level)."""
    if forced:
        monkeypatch.setenv(ENV, cpu_kernels._module().isa())
    calls, amx_calls = [], []
    real, real_amx = cpu_kernels.flash_attention, flash_prefill.prefill_attention
    monkeypatch.setattr(cpu_kernels, "flash_attention",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(flash_prefill, "prefill_attention",
                        lambda *a, **kw: amx_calls.append(a[0].shape[0]) or real_amx(*a, **kw))
    path = make_tiny_model(tmp_path / "q3", "qwen3", head_dim=32)
    greedy_tokens(engine(path, "torch"), [list(range(5, 30))], max_tokens=2)
    assert calls == amx_calls == []
    amx = amx_flash_attention(torch.bfloat16)
    assert amx == (not forced and torch.cpu._is_amx_tile_supported())
    llm = engine(path, "sage")
    assert type(llm.engine.runner.attention.prefill).__name__ == ("AmxFlashPrefill" if amx else "FlashPrefill")
    greedy_tokens(llm, [list(range(5, 30))], max_tokens=2)
    # the prompt's chunk, in each of the 2 layers; decode rows take the paged kernel
    assert (amx_calls, calls) == (([25] * 2, []) if amx else ([], [25] * 2))


def test_amx_flash_attention_is_bf16_on_amx_tiles_without_a_forced_level(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert amx_flash_attention(torch.bfloat16) == bool(torch.cpu._is_amx_tile_supported())
    assert not amx_flash_attention(torch.float32)
    monkeypatch.setenv(ENV, "avx2")
    assert not amx_flash_attention(torch.bfloat16)


@needs_bf16
def test_sage_where_it_cannot_run_is_a_config_error_and_auto_falls_back(tmp_path):
    path = make_tiny_model(tmp_path / "q3", "qwen3", head_dim=32)
    why = r"^model.prefill_attention: sage: the kernel is bf16 or fp32 only \(the model is fp16\)"
    with pytest.raises(ConfigError, match=why):
        engine(path, "sage", dtype="fp16")
    assert not engine(path, "auto", dtype="fp16").engine.runner.attention.prefill.flash
    assert engine(path, "auto").engine.runner.attention.prefill.flash
    assert engine(path, "auto", dtype="fp32").engine.runner.attention.prefill.flash == (WHY_F32 is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq, c", [(1, 1), (16, 300), (5, 64), (40, 1000)])
@pytest.mark.parametrize("window, softcap, with_sinks", [(0, 0.0, False), (100, 0.0, False), (0, 30.0, True)])
def test_keys_read_in_place_from_pool_rows_are_the_gathered_keys(cpu_isa, dtype, lq, c, window, softcap,
                                                                 with_sinks):
    """`flash_attention_slots` packs a span's context straight from a pool's token rows: the same bits as the
    kernel over the gathered copy ``k_rows[slots]`` (the chunk-after-cached-context path without its gather),
    under each kind, at every ISA level this CPU has."""
    if why := flash_unavailable(64, dtype):
        pytest.skip(f"no {dtype} flash kernel at {cpu_isa}: {why}")
    generator = torch.Generator().manual_seed(lq * 7 + c)
    heads, kv_heads, d = 6, 2, 64
    rows = 1200
    k_rows = torch.randn(rows, kv_heads, d, generator=generator).to(dtype)
    v_rows = torch.randn(rows, kv_heads, d, generator=generator).to(dtype)
    slots = torch.randperm(rows, generator=generator)[:c]  # a sequence's slots, anywhere in the pool
    q = torch.randn(lq, heads, d, generator=generator).to(dtype)
    sinks = torch.randn(heads, generator=generator) if with_sinks else None
    scale = d**-0.5
    out, lse = cpu_kernels.flash_attention_slots(q, k_rows, v_rows, slots, scale, window, softcap, sinks)
    want_out, want_lse = cpu_kernels._module().flash_attention_kind(
        q, k_rows[slots], v_rows[slots], scale, True, window, softcap, sinks)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shared_prefix_read_in_place_is_the_gathered_one(cpu_isa, dtype):
    """Not causal (a shared prefix's keys, every query row sees all of them), through whole blocks' slots."""
    if why := flash_unavailable(64, dtype):
        pytest.skip(f"no {dtype} flash kernel at {cpu_isa}: {why}")
    generator = torch.Generator().manual_seed(5)
    k_rows = torch.randn(64 * 16, 2, 64, generator=generator).to(dtype)
    v_rows = torch.randn(64 * 16, 2, 64, generator=generator).to(dtype)
    blocks = torch.tensor([9, 3, 40, 41, 7])
    slots = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
    q = torch.randn(100, 4, 64, generator=generator).to(dtype)  # more rows than keys: fine without a mask
    out, lse = cpu_kernels.flash_attention_slots(q, k_rows, v_rows, slots, 0.125, causal=False)
    want_out, want_lse = cpu_kernels._module().flash_attention(q, k_rows[slots], v_rows[slots], 0.125, False)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_slots_outside_the_rows_are_refused(cpu_isa):
    if why := flash_unavailable(64, torch.float32):
        pytest.skip(f"no fp32 flash kernel at {cpu_isa}: {why}")
    rows = torch.zeros(10, 1, 64)
    with pytest.raises(RuntimeError, match="outside k and v's 10 rows"):
        cpu_kernels.flash_attention_slots(torch.zeros(2, 1, 64), rows, rows, torch.tensor([3, 10]), 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.flash_attention_slots(torch.zeros(2, 1, 64), rows, rows, torch.tensor([3, 4], dtype=torch.int32),
                                          1.0)
