"""The byte-length lower bound on token counts holds where it is claimed, and is refused
where a tokenizer can swallow unbounded text into one token."""

from __future__ import annotations

import math

import pytest

from sage_infer.models.token_bytes import max_bytes_per_token
from sage_infer.models.tokenizer import Tokenizer
from tests.tiny_models import TEXT, save_tokenizer

BPE = {"type": "BPE", "unk_token": None, "fuse_unk": False, "byte_fallback": False}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}


def spec(**overrides) -> dict:
    return {"model": BPE, "pre_tokenizer": BYTE_LEVEL, "normalizer": None, "added_tokens": [], **overrides}


def test_byte_level_bpe_bound_is_the_longest_token():
    assert max_bytes_per_token(spec(), ["a", "Ġthe", "<|im_start|>"]) == len("<|im_start|>")


def test_the_bound_holds_on_real_text(tmp_path):
    save_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    bound = tokenizer.max_bytes_per_token
    for text in (TEXT, " " * 5000, "a" * 5000, "🙂" * 1000, "<|im_start|>" * 300):
        assert len(tokenizer.encode(text)) >= math.ceil(len(text.encode()) / bound)


@pytest.mark.parametrize("normalizer,factor", [
    ({"type": "NFKC"}, 4),
    ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                           {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}, 1),
    ({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}, 9),
])
def test_shrinking_normalizers_widen_the_bound(normalizer, factor):
    assert max_bytes_per_token(spec(normalizer=normalizer), ["abcd"]) == 4 * factor


@pytest.mark.parametrize("overrides", [
    {"model": {"type": "WordPiece"}},  # a long unknown word is one [UNK]
    {"model": {**BPE, "unk_token": "<unk>", "fuse_unk": True}},
    {"pre_tokenizer": {"type": "Whitespace"}},  # drops every space
    {"pre_tokenizer": {"type": "Split", "behavior": "Removed"}},
    {"normalizer": {"type": "Strip"}},
    {"added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]},
])
def test_no_bound_where_a_token_can_swallow_unbounded_text(overrides):
    assert max_bytes_per_token(spec(**overrides), ["abcd"]) is None
