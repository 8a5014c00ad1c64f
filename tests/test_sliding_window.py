"""Sliding-window attention read from config.json: Mistral's `sliding_window` (every layer) and Qwen2's
`use_sliding_window` + `max_window_layers` (the layers from that index on). Greedy tokens equal transformers' (eager
attention, which applies the window) for prompts longer than the window, in a batch of mixed lengths, through the
reference path and through the fast paths the engine picks here, prefix-cache hits and chunked prefill included; the
context is max_position_embeddings, not the window."""

from __future__ import annotations

import pytest
import torch
import transformers

from sage_infer import LLM, SamplingParams
from sage_infer.config.auto import ModelFacts, resolve_max_model_len
from sage_infer.config.serve import ServeConfig
from sage_infer.layers.attention_kinds import AttentionKind, kind_decode_attention, kind_prefill_attention
from sage_infer.layers.cpu_kernels import flash_unavailable, kernel_unavailable
from sage_infer.models.arch_config import ArchConfig
from tests.test_engine_vs_transformers import random_prompts
from tests.tiny_models import make_tiny_model

WINDOW = 16
MAX_NEW = 12
LENGTHS = [40, 17, 5, 33, 64, 23]  # most longer than the window
REFERENCE = {"attention": "torch", "prefill_attention": "torch", "elementwise": "torch"}
PATHS = {"reference": REFERENCE, "auto": {}}  # auto: every fast path the engine picks on this machine


def hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's MAX_NEW greedy tokens from transformers' full forward (no KV cache: every step recomputes the
    whole sequence), on one thread (a tiny model: more only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = list(prompt)
                for _ in range(MAX_NEW):
                    ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
                out.append(ids[len(prompt):])
    finally:
        torch.set_num_threads(threads)
    return out


def engine(directory, max_num_batched_tokens: int = 2048, **model) -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(directory), "dtype": "fp32", **model},
                                         "kv_pool": {"num_blocks": 96},
                                         "scheduler": {"max_num_batched_tokens": max_num_batched_tokens}})
    return LLM(config=config)


def sage_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("mistral-sw") / "model", "mistral", sliding_window=WINDOW,
                                head_dim=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompts = random_prompts(LENGTHS, seed=3)
    return directory, prompts, hf_greedy(hf, prompts)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("qwen2-sw") / "model", "qwen2", num_hidden_layers=3,
                                head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompts = random_prompts(LENGTHS, seed=4)
    return directory, prompts, hf_greedy(hf, prompts)


def test_mistral_context_is_max_position_embeddings_and_a_prompt_longer_than_the_window_serves_fully(mistral):
    directory, prompts, _ = mistral
    llm = engine(directory, **REFERENCE)
    decided = {d.field: d for d in llm.engine.decisions}
    assert decided["model.max_model_len"].value == 1024
    assert decided["model.max_model_len"].reason == "auto: the model's max_position_embeddings"
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 24 and out.outputs[0].finish_reason == "length"
    explicit = ServeConfig.model_validate({"model": {"max_model_len": 1024}})
    assert resolve_max_model_len(explicit, ModelFacts("fp32", 1024, sliding_window=WINDOW)).value == 1024


def test_the_window_changes_transformers_tokens_for_these_prompts(mistral):
    """The parity tests below would pass with the window ignored unless it changes the tokens."""
    directory, prompts, windowed = mistral
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, sliding_window=None,
                                                           attn_implementation="eager").eval()
    assert hf_greedy(hf, prompts[:2]) != windowed[:2]


@pytest.mark.parametrize("path", PATHS)
def test_mistral_sliding_window_matches_transformers(mistral, path):
    directory, prompts, want = mistral
    llm = engine(directory, **PATHS[path])
    reason = {d.field: d for d in llm.engine.decisions}["model.layer_attention"].reason
    in_place = path == "auto" and kernel_unavailable() is None  # the paged kernel reads the window's blocks
    assert ("decode rows through the paged kernel" in reason) == in_place
    flash = path == "auto" and flash_unavailable(32, torch.float32) is None
    assert ("prefill spans through the flash kernel" in reason) == flash
    assert sage_greedy(llm, prompts) == want
    assert sage_greedy(llm, prompts) == want  # again: every prompt's blocks hit the prefix cache
    assert llm.engine.kv.index.metrics.hit_blocks > 0


def test_mistral_sliding_window_with_chunked_prefill_matches_transformers(mistral):
    directory, prompts, want = mistral
    assert sage_greedy(engine(directory, max_num_batched_tokens=24), prompts) == want


@pytest.mark.parametrize("path", PATHS)
def test_qwen2_max_window_layers_matches_transformers(qwen2, path):
    directory, prompts, want = qwen2
    llm = engine(directory, **PATHS[path])
    assert [layer.self_attn.kind.window for layer in llm.engine.runner.model.model.layers] == [None, WINDOW, WINDOW]
    assert sage_greedy(llm, prompts) == want


def test_layer_windows_follow_each_family_config_fields():
    base = {"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 6, "sliding_window": 32}
    assert ArchConfig.from_hf(base, "MistralForCausalLM").layer_windows == (32,) * 6
    assert ArchConfig.from_hf(base, "LlamaForCausalLM").layer_windows == (None,) * 6  # transformers ignores it
    assert ArchConfig.from_hf(base, "Qwen2ForCausalLM").layer_windows == (None,) * 6  # use_sliding_window unset
    qwen = ArchConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 4}, "Qwen2ForCausalLM")
    assert qwen.layer_windows == (None,) * 4 + (32,) * 2
    assert ArchConfig.from_hf(base, "Gemma2ForCausalLM").layer_windows == (32, None) * 3
    gemma3 = ArchConfig.from_hf({**base, "sliding_window_pattern": 3}, "Gemma3ForCausalLM")
    assert gemma3.layer_windows == (32, 32, None) * 2
    types = ["full_attention", "sliding_attention"] * 3
    assert ArchConfig.from_hf({**base, "layer_types": types}, "Gemma3ForCausalLM").layer_windows == (None, 32) * 3
    with pytest.raises(ValueError, match="layer_types: 'chunked_attention' is not built"):
        ArchConfig.from_hf({**base, "layer_types": ["chunked_attention"] * 6}, "Gemma3ForCausalLM")


def test_window_math_equals_a_masked_softmax():
    """The kind math against a dense masked softmax written out here: prefill (a chunk after cached keys) and
    decode rows, a window and a soft-cap."""
    torch.manual_seed(0)
    kind = AttentionKind(window=5, softcap=2.0)
    q, k, v = torch.randn(7, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * 0.3
    scores = torch.tanh(scores / 2.0) * 2.0
    q_pos, k_pos = torch.arange(5, 12)[:, None], torch.arange(12)[None, :]
    scores = scores.masked_fill(~((k_pos <= q_pos) & (k_pos > q_pos - 5)), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(kind_prefill_attention(q, k, v, 0.3, kind), want)
    decoded = kind_decode_attention(q[-1:], k[None], v[None], torch.tensor([12]), 0.3, kind)
    torch.testing.assert_close(decoded[0], want[-1])


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"paged kernel: {kernel_unavailable()}")
@pytest.mark.parametrize("window", [5, 16, 21, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_window_decode_equals_the_gathered_window_math(window, dtype):
    """The paged part under a window (the kernel from the block each row's window starts in) against the gathered
    math, rows shorter than the window, on a block boundary and in between."""
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.kv_runtime import KVPool
    from sage_infer.layers.attention import DecodeGroup
    from sage_infer.layers.attention_backends.paged_decode import PagedDecode

    torch.manual_seed(1)
    block, blocks = 16, 40
    kv_dtype = KVDtype.FP32 if dtype == torch.float32 else KVDtype.BF16
    pool = KVPool(KVCacheSchema(1, 2, 32, block, kv_dtype), blocks, dtype=dtype)
    slots = torch.arange(blocks * block)
    pool.store(0, torch.randn(blocks * block, 2, 32).to(dtype), torch.randn(blocks * block, 2, 32).to(dtype), slots)
    lens = torch.tensor([1, 15, 16, 17, 47, 48, 49, 64, 100, 130])
    tables = torch.stack([torch.randperm(blocks)[:9] for _ in lens])
    group = DecodeGroup(rows=torch.arange(len(lens)), block_tables=tables, context_lens=lens)
    q = torch.randn(len(lens), 4, 32).to(dtype)
    keys, values = pool.gather_blocks(0, tables, torch.float32)
    want = kind_decode_attention(q.float(), keys, values, lens, 0.2, AttentionKind(window=window))
    got = PagedDecode().attend_kind(q, pool, 0, group, 0.2, AttentionKind(window=window))
    assert got.dtype == dtype
    tolerance = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tolerance)


def test_the_triton_prefill_reads_a_windowed_span_context_from_its_block_table():
    """The Triton part keeps block tables, not slots: the keys it hands a windowed layer equal the slot gather."""
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.kv_runtime import KVPool
    from sage_infer.layers.attention import AttentionMetadata, PrefillSpan
    from sage_infer.layers.attention_backends.triton_prefill import PagedPrefill, TritonPrefill

    torch.manual_seed(2)
    block, blocks = 16, 12
    pool = KVPool(KVCacheSchema(1, 2, 8, block, KVDtype.FP32), blocks)
    pool.store(0, torch.randn(blocks * block, 2, 8), torch.randn(blocks * block, 2, 8), torch.arange(blocks * block))
    table = [7, 2, 9, 4, 0]
    span = PrefillSpan(q_start=0, q_len=10, context_len=70, slot_start=0)
    paged = PagedPrefill(block_tables=torch.tensor([table]), spans=torch.zeros(1, 3, dtype=torch.int32),
                         tiles=torch.zeros(1, 2))
    meta = AttentionMetadata(slot_mapping=torch.zeros(10, dtype=torch.long), prefills=[span], prefill_context=paged)
    slots = torch.tensor([table[i // block] * block + i % block for i in range(70)])
    for start in (0, 16, 37):
        keys, values = (t.clone() for t in TritonPrefill().span_context(pool, 0, meta, 0, span, torch.float32, start))
        want_k, want_v = pool.gather_slots(0, slots[start:], torch.float32)  # (gathers reuse the pool's workspace)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_multimodal_gemma3_is_refused_saying_what_it_misses(tmp_path):
    import json

    from sage_infer.models.loader import ModelLoadError, arch_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"]}))
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration' is not supported: multimodal Gemma 3"):
        arch_config(tmp_path)


@pytest.mark.skipif(flash_unavailable(32, torch.float32) is not None, reason="the CPU flash kernel is not built here")
@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_window_prefill_equals_the_window_math(window, dtype):
    """Spans from the start, after cached keys, shorter and longer than the window, through the flash kernel's
    window; bf16 within its rounding."""
    from sage_infer.layers.attention_backends.flash_prefill import FlashPrefill

    if flash_unavailable(32, dtype) is not None:
        pytest.skip(f"flash kernel: {flash_unavailable(32, dtype)}")
    torch.manual_seed(3)
    for ctx_len, q_len in [(37, 37), (90, 90), (90, 23), (64, 1), (130, 70)]:
        q, k, v = (torch.randn(n, h, 32).to(dtype) for n, h in ((q_len, 4), (ctx_len, 2), (ctx_len, 2)))
        want = kind_prefill_attention(q.float(), k.float(), v.float(), 0.2, AttentionKind(window=window))
        got = FlashPrefill().attend_kind(q, k, v, 0.2, AttentionKind(window=window))
        assert got.dtype == dtype
        tolerance = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(got.float(), want, **tolerance)
