"""Tiny random Hugging Face models with a real BPE tokenizer, saved to a directory,
for checking the engine token-for-token against transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TEXT = (
    "To be, or not to be, that is the question: whether tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "All the world's a stage, and all the men and women merely players. 你好，世界。 🙂 "
) * 20

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_tokenizer(directory: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)  # made-up words give BPE enough pairs to fill the vocabulary
    words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                     for _ in range(4000))
    tok.train_from_iterator([TEXT, words], trainer)
    assert tok.get_vocab_size() == vocab_size, "tokenizer must cover the model's whole vocabulary"
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "model_max_length": 512,
    }))


def make_tiny_model(directory: Path, arch: str = "llama", vocab_size: int = 512, seed: int = 0, **overrides) -> Path:
    """Save a random `arch` model (llama, qwen2, qwen3, mistral) plus tokenizer to `directory`."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    if arch == "llama":
        common["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    if arch == "qwen3":
        common["head_dim"] = 16
    if arch == "mistral":
        common["sliding_window"] = None
    common.update(overrides)
    model = model_cls(config_cls(**common)).eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(directory, vocab_size)
    return directory


def assert_within_bf16_drift(got: list[list[int]], want: list[list[int]]) -> None:
    """Greedy tokens of two bf16 paths that differ only in fp32 summation order: each sequence's first 4
    tokens equal, and at most 1 in 4 sequences diverging later (a rounding near a tie)."""
    assert all(a[:4] == b[:4] for a, b in zip(got, want))
    assert sum(a != b for a, b in zip(got, want)) <= len(want) // 4


def greedy_tokens(llm, prompts, max_tokens: int = 10) -> list[list[int]]:
    """Each prompt's greedy tokens (ignore-EOS, `max_tokens` of them) from an `LLM`, in prompt order."""
    from sage_infer import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
