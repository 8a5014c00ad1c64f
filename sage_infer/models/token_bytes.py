"""A lower bound on how many tokens a text has, from its length in bytes alone.

Rejecting a prompt that cannot fit the context should not cost a full tokenization of
megabytes. For a BPE tokenizer that never leaves input uncovered (byte-level, or byte
fallback, no fused unknown tokens) and whose pre-tokenizers drop nothing, every token
covers at most as many input bytes as its own text has; normalizers that can shrink text
(NFC, NFKC, lowercase) multiply that by their worst shrink factor.
"""

from __future__ import annotations

from collections.abc import Iterable

# how far each normalizer can shrink UTF-8 text at worst (Hangul jamo compose 9 bytes -> 3,
# the Kelvin sign lowercases 3 -> 1, mathematical letters NFKC-fold 4 -> 1)
_SHRINK = {"Prepend": 1, "NFD": 2, "NFC": 3, "Lowercase": 3, "NFKD": 4, "NFKC": 4}
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split")


def _shrink_factor(normalizer: dict | None) -> int | None:
    """Worst-case input bytes per normalized byte; None when unbounded or unknown."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers") or []:
            inner_factor = _shrink_factor(inner)
            if inner_factor is None:
                return None
            factor *= inner_factor
        return factor
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and len(content.encode()) >= len(pattern.encode()):
            return 1
        return None
    return _SHRINK.get(kind)


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    """Whether the pre-tokenizer hands every input byte on (Whitespace and friends drop some)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(p) for p in pre_tokenizer.get("pretokenizers") or [])
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def max_bytes_per_token(spec: dict, vocab: Iterable[str]) -> float | None:
    """The most bytes of input text one token can stand for, given a parsed tokenizer.json
    `spec` and every token string of its vocabulary; None when no bound holds."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # one fused unknown token can stand for any amount of text
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None  # such a token swallows any run of whitespace next to it
    if not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None:
        return None
    longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
    if model.get("unk_token"):
        longest = max(longest, 4)  # an unknown token stands for one character
    return float(longest * factor)
