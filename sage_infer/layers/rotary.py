"""Rotary position embedding (neox / rotate-half style), with Llama-3 and linear scaling.

Reads both config styles: ``rope_theta`` + ``rope_scaling`` (transformers 4.x) and
``rope_parameters`` (transformers 5.x).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: dict) -> dict:
    """One dict with ``rope_type`` and ``rope_theta`` from either config style."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def inv_frequencies(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported yet (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, params, max_position_embeddings), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, signed sin: [T, 1, head_dim] in `dtype`, the same for every layer of
        a step (a model computes them once per forward, `apply_rotary` per layer). The sine's first
        half is negated: ``rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin`` exactly (a
        product with a negated factor is the negated product), one op instead of chunk, neg, cat."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

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
