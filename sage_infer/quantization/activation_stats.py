"""Activation statistics of a transformers causal LM over calibration windows, in one pass.

What each consumer needs:

- GPTQ: the Hessian of the layer-wise squared error, ``H = 2/n Σ_t x_t x_tᵀ`` over the n tokens
  seen by a linear's input ([in_features, in_features], fp32).
- Pruning: ``Σ_t x_j(t)²`` per input channel (e.g. the FFN intermediate entering ``down_proj``)
  and the energy ``Σ_t ‖W[:, g] x_g(t)‖²`` each contiguous group g of input features contributes
  to the output (e.g. one KV group of attention heads entering ``o_proj``): exactly what removing
  that group takes out of the layer's output.
- Static KV scales: per layer and KV head, the largest |K| and |V| written to the KV cache
  (after k-norm and rotary embedding, read back from the model's own cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class ActivationStats:
    """Accumulated statistics; every tensor is fp32 on the CPU."""

    num_tokens: int = 0
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [in, in], 2/n Σ x xᵀ
    input_sq_norms: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [in], Σ_t x_j(t)²
    group_output_energy: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [G]
    kv_amax: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer: K, V [kv_heads]


@torch.no_grad()
def collect_statistics(
    model: nn.Module,
    batches: torch.Tensor | Iterable[torch.Tensor],
    *,
    hessians: Iterable[str] = (),
    input_sq_norms: Iterable[str] = (),
    group_output_energy: Mapping[str, int] | None = None,
    kv_amax: bool = False,
    batch_size: int = 8,
) -> ActivationStats:
    """Stream `batches` through `model` once and accumulate what was asked for.

    batches: LongTensor [num_samples, seq_len] (run `batch_size` rows at a time) or an iterable
    of such tensors. Names are ``model.named_modules()`` names of ``nn.Linear`` modules;
    `group_output_energy` maps a name to the group size (input features per group, which must
    divide in_features).
    """
    group_output_energy = dict(group_output_energy or {})
    hessian_names, norm_names = list(hessians), list(input_sq_norms)
    modules = dict(model.named_modules())
    for name in {*hessian_names, *norm_names, *group_output_energy}:
        if not isinstance(modules.get(name), nn.Linear):
            raise KeyError(f"{name!r} is not an nn.Linear of this model")
    for name, size in group_output_energy.items():
        if size < 1 or modules[name].in_features % size:
            raise ValueError(f"group size {size} does not divide in_features {modules[name].in_features} of {name}")

    stats = ActivationStats()
    rows: dict[str, int] = {}

    def hook(name: str):
        def accumulate(module: nn.Linear, inputs: tuple[torch.Tensor, ...], _output) -> None:
            x = inputs[0].reshape(-1, module.in_features).float()
            rows[name] = rows.get(name, 0) + x.shape[0]
            if name in hessian_names:
                _add(stats.hessians, name, (x.T @ x).cpu())
            if name in norm_names:
                _add(stats.input_sq_norms, name, x.square().sum(0).cpu())
            if name in group_output_energy:
                _add(stats.group_output_energy, name, _group_energy(x, module.weight, group_output_energy[name]))
        return accumulate

    handles = [modules[n].register_forward_hook(hook(n))
               for n in {*hessian_names, *norm_names, *group_output_energy}]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for batch in _micro_batches(batches, batch_size):
            out = model(input_ids=batch.to(device), use_cache=kv_amax)
            stats.num_tokens += batch.numel()
            if kv_amax:
                _update_kv_amax(stats.kv_amax, out["cache"] if "cache" in out else out["past_key_values"])
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    for name, h in stats.hessians.items():
        h.mul_(2.0 / rows[name])
    return stats


def collect_hessians(
    model: nn.Module, batches: torch.Tensor, module_names: Iterable[str], batch_size: int = 8
) -> dict[str, torch.Tensor]:
    """GPTQ Hessians ``2/n Σ_t x_t x_tᵀ`` of the named linears' inputs: name -> fp32 [in, in]."""
    return collect_statistics(model, batches, hessians=module_names, batch_size=batch_size).hessians


def collect_kv_amax(
    model: nn.Module, batches: torch.Tensor, batch_size: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (|K| max, |V| max) over everything written to the KV cache: fp32 [num_kv_heads] each."""
    return collect_statistics(model, batches, kv_amax=True, batch_size=batch_size).kv_amax


def _micro_batches(batches: torch.Tensor | Iterable[torch.Tensor], batch_size: int) -> Iterable[torch.Tensor]:
    if isinstance(batches, torch.Tensor):
        if batches.dim() != 2:
            raise ValueError(f"batches must be [num_samples, seq_len], not {list(batches.shape)}")
        yield from batches.split(batch_size)
    else:
        yield from batches


def _add(acc: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    if name in acc:
        acc[name] += value
    else:
        acc[name] = value


def _group_energy(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """Σ_t ‖W[:, g] x_g(t)‖² for each contiguous input group g. x: [T, in], weight: [out, in] -> [G]."""
    w = weight.float()
    if group == 1:  # one column: ‖W[:, j]‖² Σ_t x_j(t)², no matmul needed
        return (w.square().sum(0) * x.square().sum(0)).cpu()
    num_groups = w.shape[1] // group
    return torch.stack([
        (x[:, g * group: (g + 1) * group] @ w[:, g * group: (g + 1) * group].T).square().sum()
        for g in range(num_groups)
    ]).cpu()


def _update_kv_amax(acc: list[tuple[torch.Tensor, torch.Tensor]], cache) -> None:
    """Fold one forward's cache (per layer keys/values [B, kv_heads, T, head_dim]) into `acc`."""
    for i, layer in enumerate(cache.layers):
        k = layer.keys.detach().float().abs().amax(dim=(0, 2, 3)).cpu()
        v = layer.values.detach().float().abs().amax(dim=(0, 2, 3)).cpu()
        if i < len(acc):
            acc[i] = (torch.maximum(acc[i][0], k), torch.maximum(acc[i][1], v))
        else:
            acc.append((k, v))
