"""What a model hands the C++ decode step (csrc/decode_step.cpp, `cpu_kernels.decode_layers`) about its layers: each
packed linear's numbers and tensors (`step_linear`), and their places in the KV pool: each layer's KV group and its
layer within the group's blocks, as the engine lays out the pool (`sage_infer.engine.build.use_kv_groups`), and its
attention kind."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sage_infer.kv_runtime.kv_groups import kv_groups
from sage_infer.layers.attention_kinds import AttentionKind
from sage_infer.models.arch_config import ArchConfig

if TYPE_CHECKING:
    import torch

    from sage_infer.kv_runtime.pool import KVPool
    from sage_infer.layers.linear import PackedLinear


def step_linear(linear: PackedLinear) -> tuple[list[int], torch.Tensor, tuple, tuple]:
    """A `PackedLinear` as the C++ step's ``Linear`` takes it: (address, nbytes, out_features, small_rows, bf16_rows,
    small_linear's rows per block), the packed weight, its biases (fp32 for small_linear's rows, the model's dtype)
    and its bf16 weight and bias (a bf16 layer oneDNN could not pack)."""
    small = linear.small_rows > 0
    shape = [linear._address if small else 0, linear._nbytes if small else 0, linear.out_features, linear.small_rows,
             linear.bf16_rows, linear._block_rows if small else 0]
    return shape, linear.packed, (linear._bias32 if small else None, linear.bias), (linear.weight_bf16,
                                                                                     linear.bias_bf16)


def pool_layer_map(cfg: ArchConfig, pool: KVPool) -> tuple[tuple[int, int], ...]:
    """(KV group, pool layer) of each model layer: one group of every layer unless some layer has a sliding window
    (then a block table per group, `KVGroups.layer_map`). ValueError when `pool` was laid out otherwise."""
    groups = kv_groups(cfg.layer_windows or (None,) * cfg.num_layers)
    if not groups.per_group:
        layer_map, pool_layers = tuple((0, layer) for layer in range(cfg.num_layers)), cfg.num_layers
    else:
        layer_map, pool_layers = groups.layer_map, groups.layers_per_block
    if pool.num_layers != pool_layers:
        raise ValueError(f"decode step: the pool holds {pool.num_layers} layers a block, the model's KV groups "
                         f"{pool_layers}")
    return layer_map


def layer_layout(group: int, kind: AttentionKind, local_rope: bool = False) -> list[int]:
    """A layer's entry of `decode_layers`' ``layout``: its KV group, its window (0: none), its own rope (0/1)."""
    return [group, kind.window or 0, int(local_rope)]
