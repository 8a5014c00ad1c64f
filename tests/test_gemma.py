"""Gemma 2 and Gemma 3 (text) against transformers, fp32 greedy tokens: alternating sliding-window and full layers
with prompts longer than the window, attention and final logit soft-capping (Gemma 2), query_pre_attn_scalar, the
(1 + w) norms (random, so they matter), Gemma 3's q/k norms and its sliding layers' own rope theta; through the
reference path and, at each ISA level this CPU runs, the fast paths the engine picks (the paged decode and flash
prefill kernels taking the window and the soft-cap, Gemma's norms as C++ passes and every layer of a decode step in
one C++ call), in a batch of mixed lengths. Gemma's C++ norms against its PyTorch norm."""

from __future__ import annotations

import pytest
import torch
import transformers

from sage_infer.layers import cpu_kernels
from sage_infer.layers.cpu_kernels import flash_unavailable, kernel_unavailable
from sage_infer.layers.linear import packing_unavailable
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.gemma import GemmaRMSNorm
from tests.test_decode_step import counted
from tests.test_engine_vs_transformers import random_prompts
from tests.test_sliding_window import PATHS, engine, hf_greedy, sage_greedy
from tests.tiny_models import save_tokenizer

WINDOW = 16
LENGTHS = [40, 9, 33, 57]
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
              pad_token_id=2, sliding_window=WINDOW, query_pre_attn_scalar=24)


def gemma_config(arch: str):
    if arch == "gemma2":
        return transformers.Gemma2Config(**COMMON, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    return transformers.Gemma3TextConfig(**COMMON, sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    torch.manual_seed(0)
    model_cls = transformers.Gemma2ForCausalLM if request.param == "gemma2" else transformers.Gemma3ForCausalLM
    hf = model_cls(gemma_config(request.param)).eval()
    with torch.no_grad():  # norms start at zero (a scale of 1): random ones catch a norm taken as w, not 1 + w
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.5)
    directory = tmp_path_factory.mktemp(request.param) / "model"
    hf.save_pretrained(directory)
    save_tokenizer(directory, COMMON["vocab_size"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompts = random_prompts(LENGTHS, seed=5)
    return request.param, directory, prompts, hf_greedy(hf, prompts)


def check_gemma(arch, directory, prompts, want, path: str):
    llm = engine(directory, **PATHS[path])
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.kind.window for layer in layers] == [WINDOW, None, WINDOW, None]
    assert llm.engine.max_model_len == 1024
    decided = {d.field: d for d in llm.engine.decisions}
    kernels = path == "auto" and kernel_unavailable() is None
    assert getattr(decided.get("model.elementwise"), "value", "torch") == ("fused" if kernels else "torch")
    reason = decided["model.layer_attention"].reason
    assert ("decode rows through the paged kernel" in reason) == kernels
    flash = path == "auto" and flash_unavailable(32, torch.float32) is None
    assert ("prefill spans through the flash kernel" in reason) == flash
    step_runs = kernels and packing_unavailable(torch.float32) is None
    assert llm.engine.runner.step.name == ("cpp-decode" if step_runs else "python" if path != "auto" else "fused")
    step = counted(llm) if step_runs else None
    assert sage_greedy(llm, prompts) == want
    assert step is None or step.calls >= 7  # every decode step in one C++ call, windows and soft-caps too


def test_gemma_matches_transformers(gemma):
    check_gemma(*gemma, "reference")


def test_gemma_kernels_match_transformers_at_each_isa(gemma, cpu_isa):
    """The engine's own paths (auto) at each ISA level: Gemma 2's soft-cap and both windows through the kernels."""
    check_gemma(*gemma, "auto")


needs_kernels = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_passes_match_the_pytorch_norm(dtype, cpu_isa):
    torch.manual_seed(3)
    hidden, rows = 96, 5
    norm, after = GemmaRMSNorm(hidden, 1e-6), GemmaRMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
        after.weight.normal_(0, 0.5)
    x = torch.randn(rows, 2 * hidden).to(dtype)[:, :hidden]  # strided rows
    # fp32: the sum of squares in another order, a few ulp; bf16: one rounding step
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norm.fused(x), norm(x), **tol)
    residual = torch.randn(rows, hidden).to(dtype)
    want_residual = residual + norm(x)
    got = cpu_kernels.gemma_add_rms_norms_(x, residual, norm.scale(), after.scale(), 1e-6)
    torch.testing.assert_close(residual, want_residual, **tol)
    torch.testing.assert_close(got, after(want_residual), **tol)
    heads = torch.randn(rows, 3, hidden).to(dtype)
    want_heads = norm(heads)
    cpu_kernels.gemma_norm_heads_(heads, norm.scale(), 1e-6)
    torch.testing.assert_close(heads, want_heads, **tol)


@needs_kernels
@pytest.mark.skipif(packing_unavailable(torch.bfloat16) is not None, reason="oneDNN cannot pack bf16 here")
def test_gemma_decode_step_in_bf16_is_the_python_paths_exactly(gemma):
    """The C++ step chains the passes the fused Python layer loop calls, in the same order: the same tokens."""
    _, directory, prompts, _ = gemma
    fast = engine(directory, dtype="bf16", decode_step="sage")
    step = counted(fast)
    got = sage_greedy(fast, prompts)
    assert step.calls >= 7
    assert got == sage_greedy(engine(directory, dtype="bf16", decode_step="python"), prompts)


def test_gemma3_reads_the_old_config_style_local_rope_theta():
    cfg = ArchConfig.from_hf({"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 8, "intermediate_size": 8,
                              "num_hidden_layers": 6, "sliding_window": 512, "rope_theta": 1_000_000.0,
                              "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                             "Gemma3ForCausalLM")
    assert cfg.rope["rope_theta"] == 1_000_000.0 and cfg.rope["rope_type"] == "linear"
    assert cfg.rope_local == {"rope_type": "default", "rope_theta": 10_000.0}
    assert cfg.tie_word_embeddings and cfg.layer_windows == (512,) * 5 + (None,)


def test_gemma_with_another_activation_is_refused_naming_the_field(tmp_path):
    cfg = ArchConfig.from_hf({"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 8, "intermediate_size": 8,
                              "num_hidden_layers": 2, "hidden_activation": "relu"}, "Gemma2ForCausalLM")
    from sage_infer.models.registry import build_model

    with pytest.raises(ValueError, match="hidden_activation: 'relu' is not built"):
        build_model(cfg)


def test_bidirectional_gemma3_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="use_bidirectional_attention: true is not built"):
        ArchConfig.from_hf({"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 8, "intermediate_size": 8,
                            "num_hidden_layers": 2, "use_bidirectional_attention": True}, "Gemma3ForCausalLM")
