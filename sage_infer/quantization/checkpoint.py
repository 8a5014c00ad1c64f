"""Write a weight-only quantized copy of a Hugging Face model directory (compressed-tensors
pack-quantized), what `sage compress quantize` runs.

Quantized: the linear layers of every decoder layer (q/k/v/o projections, gate/up/down), a mixture of
experts' experts one linear each as checkpoints store them (``mlp.experts.<e>.gate_proj``, Mixtral's
``block_sparse_moe.experts.<e>.w1``) and a shared expert's. Kept as they are: embeddings, norms, biases,
routers (``mlp.gate``, ``shared_expert_gate``) and lm_head. Experts stored stacked in one tensor are refused.
Every file of the source directory other than config.json and the safetensors weights (tokenizer, generation
config, chat template, ...) is copied.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sage_infer.errors import UsageError
from sage_infer.quantization.compressed_tensors import encode_weight, quantization_config
from sage_infer.quantization.weights import QuantizedWeight, WeightScheme, quantize_rtn

# a decoder layer's linear weights, as the Llama family and its mixture-of-experts kin name them
LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_expert\.)?"
                           r"(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
EXPERT_WEIGHT = re.compile(r"\.(experts\.\d+|shared_expert)\.")
# every expert of a layer in one tensor ([E, 2I, H] / [E, H, I], gpt-oss's and transformers' in-memory layout)
STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")
INDEX = "model.safetensors.index.json"

# (module name, weight [out, in]) -> its quantized weight
Quantizer = Callable[[str, torch.Tensor], QuantizedWeight]


@dataclass(slots=True)
class QuantizeReport:
    """What was written: counts and bytes of the weights before / after."""

    out_dir: str
    scheme: str
    method: str
    quantized_layers: int = 0
    kept_tensors: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    files: list[str] = field(default_factory=list)


def is_quantized_linear(name: str) -> bool:
    """Whether checkpoint tensor `name` is a linear weight `quantize_checkpoint` quantizes."""
    return LINEAR_WEIGHT.match(name) is not None


def source_files(src: Path) -> list[Path]:
    """The safetensors files of `src` (from its shard index when it has one)."""
    index = src / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [src / name for name in sorted(set(weight_map.values()))]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{src}: no *.safetensors weights to quantize")
    return files


def has_experts(src: Path) -> bool:
    """Whether `src` stores mixture-of-experts expert linears `quantize_checkpoint` would quantize."""
    from safetensors import safe_open

    for file in source_files(src):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            if any(is_quantized_linear(name) and EXPERT_WEIGHT.search(name) for name in handle.keys()):
                return True
    return False


def check_shapes(src: Path, scheme: WeightScheme) -> None:
    """UsageError naming the first linear whose input width the group size does not divide, or the first
    stacked expert tensor (not implemented)."""
    from safetensors import safe_open

    for file in source_files(src):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if STACKED_EXPERTS.search(name):
                    raise UsageError(f"{name}: experts stacked in one tensor are not implemented yet for "
                                     f"quantization (one tensor per expert is)")
                if is_quantized_linear(name):
                    out_f, in_f = handle.get_slice(name).get_shape()
                    if in_f % scheme.group_of(in_f):
                        raise UsageError(f"--group-size {scheme.group_size}: {name} has {in_f} input columns, "
                                         f"not a multiple of it")


def quantize_checkpoint(src: Path, out: Path, scheme: WeightScheme, method: str = "rtn",
                        quantizer: Quantizer | None = None) -> QuantizeReport:
    """Write the quantized copy of `src` to `out` (created; must not hold a model already).

    `quantizer(module_name, weight)` quantizes one linear (default: round-to-nearest); GPTQ passes
    one that uses its calibration Hessians. `method` is recorded in the report.
    """
    from safetensors.torch import load_file, save_file

    config_path = src / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"{config_path}: cannot read: {err}") from None
    if "quantization_config" in config:
        raise UsageError(f"{config_path}: already quantized (quantization_config is set)")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out}: exists and is not empty")
    check_shapes(src, scheme)
    quantize = quantizer or (lambda _name, weight: quantize_rtn(weight, scheme))
    out.mkdir(parents=True, exist_ok=True)
    report = QuantizeReport(str(out), scheme.name, method)
    weight_map: dict[str, str] = {}
    for file in source_files(src):
        tensors = load_file(str(file))
        written: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            report.bytes_before += tensor.nbytes
            if not is_quantized_linear(name):
                written[name] = tensor
                report.kept_tensors += 1
                continue
            prefix = name.removesuffix(".weight")
            for suffix, value in encode_weight(quantize(prefix, tensor)).items():
                written[f"{prefix}.{suffix}"] = value
            report.quantized_layers += 1
        report.bytes_after += sum(t.nbytes for t in written.values())
        save_file({k: v.contiguous() for k, v in written.items()}, str(out / file.name), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in written})
        report.files.append(file.name)
    if (src / INDEX).is_file():
        index = json.loads((src / INDEX).read_text())
        index["weight_map"] = weight_map
        index.setdefault("metadata", {})["total_size"] = report.bytes_after
        (out / INDEX).write_text(json.dumps(index, indent=2))
    config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX):
            shutil.copy2(path, out / path.name)
    return report
