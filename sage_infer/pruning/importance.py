"""Importance of FFN channels and KV groups of attention heads, measured on calibration text.

The score of a structure is the energy of exactly what removing it takes out of its layer's
output, summed over the calibration tokens:

- FFN channel j of layer l: ``Σ_t ‖W_down[:, j] h_j(t)‖² = ‖W_down[:, j]‖² · Σ_t h_j(t)²`` where
  h = act(gate(x)) * up(x) is the input of ``down_proj`` — the structured form of Wanda's
  ``|W| · ‖x‖`` (a whole column of down_proj with the norm of its input channel).
- KV group g (KV head g and its ``group_size`` query heads): ``Σ_t ‖W_o[:, cols(g)] a_g(t)‖²``
  where a_g is the attention output of those query heads (the input of ``o_proj`` they own).
  Cross-head terms are included, so this is the exact squared error of dropping that group alone.

Low score = little output removed = pruned first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sage_infer.quantization.activation_stats import ActivationStats, collect_statistics


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The numbers that fix how heads map onto ``o_proj`` columns."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head; query head q belongs to KV head ``q // group_size``."""
        return self.num_heads // self.num_kv_heads


def down_proj(layer: int) -> str:
    return f"model.layers.{layer}.mlp.down_proj"


def o_proj(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.o_proj"


def collect_importance_stats(
    model: torch.nn.Module, batches: torch.Tensor, shape: AttentionShape, ffn: bool, heads: bool, batch_size: int = 8
) -> ActivationStats:
    """One pass over `batches` [num_samples, seq_len] collecting the energies the scores need."""
    energy: dict[str, int] = {}
    for layer in range(shape.num_layers):
        if ffn:
            energy[down_proj(layer)] = 1
        if heads:
            energy[o_proj(layer)] = shape.group_size * shape.head_dim
    return collect_statistics(model, batches, group_output_energy=energy, batch_size=batch_size)


def ffn_channel_scores(stats: ActivationStats, layer: int) -> torch.Tensor:
    """Score of every FFN channel of `layer`: [intermediate_size]."""
    return stats.group_output_energy[down_proj(layer)]


def kv_group_scores(stats: ActivationStats, layer: int) -> torch.Tensor:
    """Score of every KV group of `layer`: [num_kv_heads]."""
    return stats.group_output_energy[o_proj(layer)]


def keep_highest(scores: torch.Tensor, num_remove: int) -> list[int]:
    """Indices kept after removing the `num_remove` lowest scores, ascending (ties keep the lower index)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return sorted(order[: len(scores) - num_remove].tolist())
