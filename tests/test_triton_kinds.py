"""The Triton paged kernels under a layer's attention kind (any sliding window, a shorter one than a block too, a logit
soft-cap, attention sinks, and all three) against the PyTorch math of `sage_infer.layers.attention_kinds` (the path
the backend took before the kernels took kinds): the decode kernel in place, split or not, and the prefill kernel over
every span of a step in one launch. Without a GPU the kernel code runs under Triton's interpreter (tests/conftest.py),
on small shapes."""

from __future__ import annotations

import pytest
import torch

from sage_infer.layers.attention_kinds import AttentionKind, kind_decode_attention, kind_prefill_attention
from sage_infer.layers.triton_paged import decode_attention, interpreting, prefill_attention, prefill_tiles, triton
from tests import kv_fill
from tests.kv_fill import LAYER

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    triton is None or not (CUDA or interpreting()),
    reason="triton is not installed" if triton is None else "no CUDA GPU and TRITON_INTERPRET is not 1")
FP32 = dict(atol=2e-5, rtol=1e-5)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def kinds() -> list[AttentionKind]:
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) * 1.5
    return [AttentionKind(window=3), AttentionKind(window=21), AttentionKind(softcap=0.7),
            AttentionKind(sinks=sinks.to(DEVICE)), AttentionKind(window=5, softcap=5.0, sinks=sinks.to(DEVICE))]


def padded(tables):
    width = max(map(len, tables)) + 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


def test_decode_kernel_takes_any_window_softcap_and_sinks():
    """Windows shorter than a block (ending inside the block they start in) and longer ones, rows shorter than the
    window; split contexts (a split before the window sees nothing; split 0 holds the sinks); the lse counts the
    sink as the CPU kernel's does."""
    lens, block = [1, 4, 9, 30, 90], 8
    pool, tables, contexts = kv_fill.filled_pool(lens, KV_HEADS, HEAD_DIM, block, torch.float32, 1, DEVICE)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device=DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    width = max(lens)
    keys = torch.stack([torch.cat([k, k.new_zeros(width - len(k), *k.shape[1:])]) for k, _ in contexts])
    values = torch.stack([torch.cat([v, v.new_zeros(width - len(v), *v.shape[1:])]) for _, v in contexts])
    every = kinds()
    for kind, splits in [(kind, 3) for kind in every] + [(every[3], 1), (every[4], 1)]:
        out, lse = decode_attention(q, *pool.block_views(LAYER), padded(tables), lens_t, 0.3, splits=splits,
                                    kind=kind)
        cpu_kind = AttentionKind(kind.window, kind.softcap, None if kind.sinks is None else kind.sinks.cpu())
        want = kind_decode_attention(q.cpu(), keys, values, lens_t.cpu(), 0.3, cpu_kind)
        torch.testing.assert_close(out.cpu(), want, **FP32, msg=lambda m, k=kind: f"{k.describe()}: {m}")
        if kind.sinks is not None and kind.window is None and kind.softcap is None:
            scores = torch.einsum("hd,thd->ht", q[-1].cpu(),
                                  keys[-1].repeat_interleave(HEADS // KV_HEADS, dim=1)) * 0.3
            want_lse = torch.cat([scores, kind.sinks.cpu()[:, None]], 1).logsumexp(1)
            torch.testing.assert_close(lse[-1].cpu(), want_lse, atol=1e-4, rtol=1e-5)


def test_prefill_kernel_takes_any_window_softcap_and_sinks():
    """Every span of a step in one launch per kind: whole prompts and chunks after cached context, a span of one
    query, a span longer than a tile of queries (its later tile's key loop starts at its window); a window shorter
    than a block and one longer than some contexts."""
    shapes, block = [(1, 1), (6, 6), (3, 40), (70, 75)], 8  # (queries, context tokens)
    pool, tables, contexts = kv_fill.filled_pool([c for _, c in shapes], KV_HEADS, HEAD_DIM, block, torch.float32, 2,
                                                 DEVICE)
    firsts = [sum(n for n, _ in shapes[:i]) for i in range(len(shapes))]
    spans = [(first, n, c) for first, (n, c) in zip(firsts, shapes)]
    q = torch.randn(sum(n for n, _ in shapes), HEADS, HEAD_DIM, device=DEVICE)
    tiles = torch.tensor(prefill_tiles(spans), dtype=torch.int32, device=DEVICE)
    for kind in kinds():
        out = torch.full_like(q, float("nan"))
        prefill_attention(q, *pool.block_views(LAYER), out, padded(tables),
                          torch.tensor(spans, dtype=torch.int32, device=DEVICE), tiles, 0.3, kind=kind)
        cpu_kind = AttentionKind(kind.window, kind.softcap, None if kind.sinks is None else kind.sinks.cpu())
        for (first, n, _), (k, v) in zip(spans, contexts):
            want = kind_prefill_attention(q[first : first + n].cpu(), k, v, 0.3, cpu_kind)
            torch.testing.assert_close(out[first : first + n].cpu(), want, **FP32,
                                       msg=lambda m, k=kind: f"{k.describe()}: {m}")


def test_forward_kind_with_the_prefill_kernel_equals_the_reference():
    """A mixed step of a windowed, soft-capped layer with sinks through `paged_attention`: with the Triton prefill
    part every span attends in one launch in place (its earlier context read from the pool), against the reference
    backend (the PyTorch math over gathered context); the decode rows alike in both."""
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.core.sampling_params import SamplingParams
    from sage_infer.core.sequence import Sequence
    from sage_infer.engine.model_runner import ModelRunner
    from sage_infer.kv_runtime import KVPool
    from sage_infer.layers.attention import paged_attention
    from sage_infer.layers.attention_backends import REFERENCE, attention_backend
    from tests.kv_fill import LAYERS

    torch.manual_seed(5)
    block, shapes = 8, [(0, 11), (30, 9), (20, 1)]  # (cached, new tokens): a prompt, a chunk after context, a row
    pool = KVPool(KVCacheSchema(LAYERS, KV_HEADS, HEAD_DIM, block, KVDtype.FP32), 16, device=DEVICE)
    seqs, free = [], list(range(16))
    for cached, new in shapes:
        seq = Sequence(len(seqs), f"r{len(seqs)}", 0, list(range(1, cached + new + 1)), cached + new,
                       SamplingParams(), b"")
        seq.block_table = [free.pop() for _ in range(-(-(cached + new) // block))]
        seq.num_computed_tokens = cached
        seqs.append(seq)
        slots = torch.tensor([seq.block_table[p // block] * block + p % block for p in range(cached)], dtype=torch.long,
                             device=DEVICE)
        pool.store(LAYER, *(torch.randn(cached, KV_HEADS, HEAD_DIM, device=DEVICE) for _ in "kv"), slots)
    news = [new for _, new in shapes]
    q, k, v = (torch.randn(sum(news), h, HEAD_DIM, device=DEVICE) for h in (HEADS, KV_HEADS, KV_HEADS))
    kind = kinds()[-1]
    triton_prefill = attention_backend(prefill="triton")
    assert triton_prefill.kind_routes([kind], DEVICE, block)[1] == "prefill spans through the sage kernel"
    outs = []
    for backend in (triton_prefill, REFERENCE):
        _, meta = ModelRunner(None, pool, DEVICE, attention=backend).prepare(seqs, news)
        assert len(meta.prefills) == 2
        outs.append(paged_attention(q, k, v, pool, LAYER, meta, 0.3, kind))
    torch.testing.assert_close(outs[0], outs[1], **FP32)


# -- the engine on a CUDA device ------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not CUDA, reason="the engine on a CUDA device needs a CUDA GPU")


@needs_gpu
def test_gpt_oss_on_the_gpu_runs_every_kind_and_expert_in_triton_and_matches_transformers(tmp_path, monkeypatch):
    """gpt-oss (windows of 8 beside full layers, sinks on both, clamped-SwiGLU experts with biases) on the GPU, fp32:
    decode rows and prefill spans of every layer through the Triton kernels, the experts through the Triton grouped
    launches; greedy tokens equal transformers' (on the CPU), with prefix hits."""
    import transformers

    from sage_infer import LLM
    from sage_infer.config.serve import ServeConfig
    from sage_infer.layers import triton_moe
    from tests.test_gpt_oss import CONFIG, hf_reference, shared_prefix_prompts
    from tests.test_sliding_window import hf_greedy, sage_greedy
    from tests.tiny_models import save_tokenizer

    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():  # random sinks, router and expert weights large enough to decide tokens
        for name, param in hf.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0, 1.5)
            elif ".mlp." in name:
                param.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "model")
    save_tokenizer(tmp_path / "model", CONFIG["vocab_size"])
    hf = hf_reference(tmp_path / "model")
    prompts = shared_prefix_prompts()
    calls, kernel = [], triton_moe.clamped_swiglu_experts
    monkeypatch.setattr(triton_moe, "clamped_swiglu_experts", lambda *args: calls.append(1) or kernel(*args))
    config = ServeConfig.model_validate({"model": {"path": str(tmp_path / "model"), "dtype": "fp32"},
                                         "kv_pool": {"num_blocks": 96}})
    llm = LLM(config=config, device="cuda")
    reason = {d.field: d for d in llm.engine.decisions}["model.layer_attention"].reason
    assert "decode rows through the paged kernel" in reason and "prefill spans through the sage kernel" in reason
    assert sage_greedy(llm, prompts[:1]) + sage_greedy(llm, prompts[1:]) == hf_greedy(hf, prompts)
    assert calls
