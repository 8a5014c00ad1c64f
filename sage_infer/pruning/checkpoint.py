"""Write a pruned copy of a Hugging Face checkpoint: sliced safetensors, config.json, the rest copied.

Tensors keep their names, dtype and shard layout. Per layer l, with the kept FFN channels C and
the kept KV heads K (query heads Q = the groups of K, head_dim D):

    q_proj.weight/bias   rows of Q (D each)        k_proj, v_proj .weight/bias   rows of K (D each)
    o_proj.weight        columns of Q (D each)     o_proj.bias, q_norm, k_norm   unchanged
    gate_proj, up_proj   rows of C                 down_proj.weight              columns of C
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from sage_infer.pruning.importance import AttentionShape

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
NOT_COPIED = {"config.json", "model.safetensors.index.json", "README.md"}  # rewritten, or no longer true
_KEY = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
                  r"down_proj)\.(weight|bias)$")


@dataclass(frozen=True, slots=True)
class LayerKeep:
    """What one decoder layer keeps, ascending indices."""

    ffn_channels: list[int]
    kv_heads: list[int]


def query_heads(kv_heads: list[int], group_size: int) -> list[int]:
    """The query heads that read the given KV heads (query head q reads KV head q // group_size)."""
    return [h * group_size + i for h in kv_heads for i in range(group_size)]


def _rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.tensor([h * head_dim + d for h in heads for d in range(head_dim)], dtype=torch.long)


def prune_tensor(name: str, tensor: torch.Tensor, keep: list[LayerKeep], shape: AttentionShape) -> torch.Tensor:
    """`tensor` with the pruned rows/columns removed when `name` is a sliced projection, else itself."""
    m = _KEY.match(name)
    if m is None:
        return tensor
    layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
    plan = keep[layer]
    if proj in ("gate_proj", "up_proj"):
        return tensor.index_select(0, torch.tensor(plan.ffn_channels, dtype=torch.long)).contiguous()
    if proj == "down_proj":
        return tensor if kind == "bias" else tensor.index_select(1, torch.tensor(plan.ffn_channels)).contiguous()
    q_rows = _rows(query_heads(plan.kv_heads, shape.group_size), shape.head_dim)
    if proj == "q_proj":
        return tensor.index_select(0, q_rows).contiguous()
    if proj in ("k_proj", "v_proj"):
        return tensor.index_select(0, _rows(plan.kv_heads, shape.head_dim)).contiguous()
    return tensor if kind == "bias" else tensor.index_select(1, q_rows).contiguous()  # o_proj


def write_pruned(
    src: Path, out: Path, weight_files: list[Path], keep: list[LayerKeep], shape: AttentionShape,
    config_updates: dict, record: dict,
) -> int:
    """Write the pruned checkpoint of `src` to `out`; return the number of parameters written."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    num_params, num_bytes = 0, 0
    for file in weight_files:
        tensors = {name: prune_tensor(name, t, keep, shape) for name, t in load_file(str(file)).items()}
        num_params += sum(t.numel() for t in tensors.values())
        num_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = num_bytes
        (out / index.name).write_text(json.dumps(data, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config.update(config_updates)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in NOT_COPIED and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)
    (out / "pruning.json").write_text(json.dumps(record, indent=2) + "\n")
    return num_params
