"""The bundled demo model (sage_infer/demo_model/) loads offline and writes word-like text.

Built by tools/train_demo_model.py; see docs/demo_model.md.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "sage_infer" / "demo_model"
MAX_BYTES = 10_000_000  # model.safetensors budget (10 MB)
FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
    "wordlist.txt",
]
CHAT_EXPECTED = (
    "<s><|im_start|>system\nYou are a player.<|im_end|>\n"
    "<|im_start|>user\nWho goes there?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def offline():
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ[k] = "1"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tokenizer(offline):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def model(offline):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    return m.eval()


def test_files_exist():
    missing = [f for f in FILES if not (DEMO / f).is_file()]
    assert not missing, f"missing in {DEMO}: {missing}"


def test_safetensors_size():
    size = (DEMO / "model.safetensors").stat().st_size
    assert 1_000_000 < size <= MAX_BYTES, size


def test_config_is_small_llama_with_gqa():
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 512
    assert isinstance(cfg["bos_token_id"], int) and isinstance(cfg["eos_token_id"], int)


def test_loads_offline(model, tokenizer):
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token == "<pad>" and tokenizer.unk_token == "<unk>"
    assert tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = model.generation_config.eos_token_id
    assert im_end in (eos if isinstance(eos, list) else [eos])


def test_tokenizer_round_trip(tokenizer):
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n  It is the east.\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(special, add_special_tokens=False).input_ids) == 1


def test_greedy_generation_is_wordlike(model, tokenizer):
    torch = pytest.importorskip("torch")
    words = set((DEMO / "wordlist.txt").read_text().split())
    assert len(words) > 1000
    inputs = tokenizer("ROMEO:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=30,
            do_sample=False,
            temperature=None,
            top_k=None,
            top_p=None,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, inputs.input_ids.shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert len(new) >= 10, repr(text)
    ok = sum(c.isalpha() or c in " \n.,;:!?'\"-()" for c in text)
    assert ok / max(1, len(text)) >= 0.7, repr(text)
    assert " " in text, repr(text)
    found = {w for w in re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower()) if len(w) >= 3 and w in words}
    assert len(found) >= 3, (found, text)


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "You are a player."},
        {"role": "user", "content": "Who goes there?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == CHAT_EXPECTED
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == CHAT_EXPECTED.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2
    assert tokenizer.decode(ids) == rendered
