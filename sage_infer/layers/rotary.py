"""Rotary position embedding (neox / rotate-half style), with Llama-3, linear and YaRN scaling.

YaRN (``rope_type: yarn``; gpt-oss) follows transformers' ``_compute_yarn_parameters``: inverse frequencies blended
between the original and the ``factor``-interpolated ones over a ramp of dimensions set by ``beta_fast`` /
``beta_slow`` (rounded outwards unless ``truncate`` is false), and cos/sin scaled by an attention factor
(``attention_factor``, else ``0.1 * ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim`` ratio).

Reads both config styles: ``rope_theta`` + ``rope_scaling`` (transformers 4.x) and
``rope_parameters`` (transformers 5.x).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: dict) -> dict:
    """One dict with ``rope_type`` and ``rope_theta`` from either config style."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def inv_frequencies(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling. ValueError naming the field for a rope sage does
    not build."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not built (built: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not built (every head "
                         f"dimension rotates here)")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "yarn":
        return _yarn_inv_frequencies(inv_freq, head_dim, base, params, max_position_embeddings)
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings", max_position_embeddings))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _yarn_factor(params: dict, max_position_embeddings: int) -> float:
    """YaRN's ``factor`` (when unset: the context's growth over ``original_max_position_embeddings``)."""
    if params.get("factor") is not None:
        return float(params["factor"])
    return max_position_embeddings / float(params.get("original_max_position_embeddings", max_position_embeddings))


def _yarn_inv_frequencies(inv_freq: torch.Tensor, head_dim: int, base: float, params: dict,
                          max_position_embeddings: int) -> torch.Tensor:
    """YaRN's blend of the extrapolated (`inv_freq`) and the ``factor``-interpolated frequencies."""
    factor = _yarn_factor(params, max_position_embeddings)
    old_len = float(params.get("original_max_position_embeddings", max_position_embeddings))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (factor * base ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim))
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation


def attention_scaling(params: dict, max_position_embeddings: int) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention factor, 1.0 for the other rope types."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position_embeddings)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
    return mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, params, max_position_embeddings), persistent=False)
        self.attention_scaling = attention_scaling(params, max_position_embeddings)  # YaRN's; else 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, signed sin: [T, 1, head_dim] in `dtype`, the same for every layer of
        a step (a model computes them once per forward, `apply_rotary` per layer). The sine's first
        half is negated: ``rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin`` exactly (a
        product with a negated factor is the negated product), one op instead of chunk, neg, cat. Both are scaled
        by `attention_scaling` (YaRN) in float32, as transformers scales them."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (neox style). x: [T, heads, head_dim] (q, k, or both side
    by side); cos, signed_sin: [T, 1, head_dim] (`RotaryEmbedding.cos_sin`)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
