"""Structured pruning writes a checkpoint that transformers and sage load and agree on, that
computes exactly what the original computes with the removed channels and heads silenced,
and removes the structures the calibration text shows to matter least."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import sage_infer
from sage_infer import LLM
from sage_infer.pruning.checkpoint import query_heads
from sage_infer.pruning.structured import PruneSpec, prune_checkpoint
from tests.test_engine_vs_transformers import GREEDY, assert_same_as_hf, random_prompts
from tests.tiny_models import make_tiny_model

DEMO = Path(sage_infer.__file__).parent / "demo_model"
FAST_CALIB = dict(calib_samples=4, calib_seq_len=64)


def load_hf(directory: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pruned_demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pruned") / "demo"
    prune_checkpoint(DEMO, out, PruneSpec(ffn="25%", heads=2, **FAST_CALIB))
    return out


def test_pruned_demo_has_the_requested_sizes_and_keeps_dtype_and_tokenizer(pruned_demo):
    config = json.loads((pruned_demo / "config.json").read_text())
    assert (config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (528, 4, 2, 32)  # 704 - 25 %; 2 of 4 KV groups (2 query heads each)
    with safe_open(str(pruned_demo / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.bfloat16
        assert f.get_slice("model.layers.2.self_attn.q_proj.weight").get_shape() == [128, 256]
        assert f.get_slice("model.layers.2.self_attn.o_proj.weight").get_shape() == [256, 128]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (pruned_demo / name).read_bytes() == (DEMO / name).read_bytes()


def test_pruned_demo_greedy_tokens_match_transformers(pruned_demo):
    hf = load_hf(pruned_demo)
    llm = LLM(str(pruned_demo), dtype="fp32", num_blocks=64)
    prompts = random_prompts([3, 17, 40], seed=5, vocab=(6, 4000))
    assert_same_as_hf(hf, prompts, llm.generate(prompts, GREEDY))


def silenced_original(original: Path, record: dict) -> transformers.PreTrainedModel:
    """The original model with every removed FFN channel and query head zeroed at its output projection."""
    model = load_hf(original)
    group = record["before"]["num_attention_heads"] // record["before"]["num_key_value_heads"]
    with torch.no_grad():
        for layer, keep in zip(model.model.layers, record["layers"]):
            head_dim = layer.self_attn.head_dim
            dropped = set(range(layer.mlp.down_proj.in_features)) - set(keep["ffn_channels_kept"])
            layer.mlp.down_proj.weight[:, sorted(dropped)] = 0
            kept_q = set(query_heads(keep["kv_heads_kept"], group))
            for q in set(range(record["before"]["num_attention_heads"])) - kept_q:
                layer.self_attn.o_proj.weight[:, q * head_dim:(q + 1) * head_dim] = 0
    return model


def with_random_biases(directory: Path) -> Path:
    """Llama with attention and MLP biases, made non-zero so that slicing them matters."""
    model = load_hf(directory)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("arch", ["llama", "llama-bias", "qwen2", "qwen3"])
def test_pruning_computes_what_the_silenced_original_computes(tmp_path, arch):
    if arch == "llama-bias":
        original = with_random_biases(make_tiny_model(tmp_path / "original", "llama", attention_bias=True,
                                                      mlp_bias=True))
    else:
        original = make_tiny_model(tmp_path / "original", arch)
    out = tmp_path / "pruned"
    prune_checkpoint(original, out, PruneSpec(ffn="25%", heads=1, **FAST_CALIB))
    record = json.loads((out / "pruning.json").read_text())
    ids = torch.tensor(random_prompts([20, 20], seed=1))
    with torch.no_grad():
        expected = silenced_original(original, record)(ids).logits
        got = load_hf(out)(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    hf = load_hf(out)
    llm = LLM(str(out), dtype="fp32", num_blocks=64)
    prompts = random_prompts([5, 23], seed=2)
    assert_same_as_hf(hf, prompts, llm.generate(prompts, GREEDY))


def test_sharded_checkpoint_keeps_its_shards_and_index(tmp_path):
    original = make_tiny_model(tmp_path / "original", "qwen3")
    load_hf(original).save_pretrained(original, max_shard_size="200KB")
    (original / "model.safetensors").unlink(missing_ok=True)
    source_index = json.loads((original / "model.safetensors.index.json").read_text())
    assert len(set(source_index["weight_map"].values())) > 1
    out = tmp_path / "pruned"
    prune_checkpoint(original, out, PruneSpec(ffn="10%", **FAST_CALIB))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == source_index["weight_map"]
    total = 0
    for shard in set(index["weight_map"].values()):
        with safe_open(str(out / shard), framework="pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert index["metadata"]["total_size"] == total
    ids = torch.tensor(random_prompts([16], seed=3))
    record = json.loads((out / "pruning.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(load_hf(out)(ids).logits, silenced_original(original, record)(ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_importance_removes_a_silent_channel_and_a_silent_kv_group_first(tmp_path):
    original = make_tiny_model(tmp_path / "original", "llama")
    model = load_hf(original)
    dead_channel = {0: 5, 1: 90}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.mlp.down_proj.weight[:, dead_channel[i]] = 0  # this channel writes nothing
            layer.self_attn.o_proj.weight[:, 0:32] *= 1e-3  # KV group 0 (query heads 0, 1) barely writes
    model.save_pretrained(original)
    prune_checkpoint(original, tmp_path / "pruned", PruneSpec(ffn="1", heads=1, **FAST_CALIB))
    record = json.loads((tmp_path / "pruned" / "pruning.json").read_text())
    for i, layer in enumerate(record["layers"]):
        assert set(range(128)) - set(layer["ffn_channels_kept"]) == {dead_channel[i]}
        assert layer["kv_heads_kept"] == [1] and layer["query_heads_kept"] == [2, 3]


def test_cli_prunes_with_a_calibration_file_and_reports_json(sage, tmp_path):
    original = make_tiny_model(tmp_path / "original", "llama")
    calib = tmp_path / "calib.txt"
    calib.write_text("Now is the winter of our discontent made glorious summer by this sun of York.\n" * 30)
    result = sage("compress", "prune", str(original), str(tmp_path / "out"), "--ffn", "50%", "--heads", "1",
                  "--calib-file", str(calib), "--calib-samples", "3", "--calib-seq-len", "32", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["intermediate_size"] == [128, 64] and report["num_key_value_heads"] == [2, 1]
    assert report["calibration"] == str(calib) and report["calibration_tokens"] == 3 * 32
    assert report["params"][1] < report["params"][0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bad-flags") / "llama", "llama")  # 4 heads, 2 KV heads


@pytest.mark.parametrize("flags, names", [
    (["--ffn", "100%"], "--ffn 100%"),
    (["--ffn", "-5%"], "--ffn -5%"),
    (["--ffn", "lots"], "--ffn lots"),
    (["--ffn", "128"], "--ffn 128"),
    (["--heads", "2"], "--heads 2"),
    (["--heads", "-1"], "--heads -1"),
    ([], "nothing to prune"),
    (["--heads", "1", "--calib-samples", "0"], "--calib-samples 0"),
    (["--heads", "1", "--calib-seq-len", "5000"], "--calib-seq-len 5000"),
    (["--heads", "1", "--calib-file", "/nonexistent/calib.txt"], "--calib-file /nonexistent/calib.txt"),
])
def test_bad_flag_is_one_line_naming_it_exit_2(sage, tiny_llama, tmp_path, flags, names):
    result = sage("compress", "prune", str(tiny_llama), str(tmp_path / "out"), *flags)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in result.err
    assert not (tmp_path / "out").exists()


def test_heads_that_transformers_cannot_load_are_rejected_with_the_values_that_work(sage, tmp_path):
    # Demo: hidden 256, 8 query heads in 4 KV groups; LlamaConfig needs 256 % num_attention_heads == 0
    result = sage("compress", "prune", str(DEMO), str(tmp_path / "out"), "--heads", "1")
    assert result.code == 2 and result.err.count("\n") == 1
    assert "--heads 1: leaves 6 query heads" in result.err and "allows: 2, 3" in result.err


def test_missing_model_dir_and_non_empty_out_are_one_line_exit_2(sage, tiny_llama, tmp_path):
    result = sage("compress", "prune", str(tmp_path / "nope"), str(tmp_path / "out"), "--heads", "1")
    assert result.code == 2 and result.err.count("\n") == 1 and f"MODEL {tmp_path / 'nope'}" in result.err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    result = sage("compress", "prune", str(tiny_llama), str(tmp_path / "busy"), "--heads", "1")
    assert result.code == 2 and result.err.count("\n") == 1 and f"OUT {tmp_path / 'busy'}" in result.err
