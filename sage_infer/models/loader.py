"""Load a Hugging Face model directory from disk: config.json and safetensors weights
(single file or sharded with ``model.safetensors.index.json``). Never the network.

A config.json with a ``quantization_config`` (compressed-tensors, weight-only int4 / int8) loads
its quantized linears as `QuantLinear` (the reference path: dequantize, then F.linear); the
engine may swap them for CPU kernels afterwards (`sage_infer.layers.quant_linear.use_quant_kernels`).
Anything else in a quantization_config is a ModelLoadError naming the field. Quantized MoE experts load as one
`QuantLinear` each (`sage_infer.models.moe.MoeForCausalLM.separate_experts`).

A tensor whose name no parameter has goes where the model's ``checkpoint_target`` says: MoE checkpoints store
each expert's weights apart, and the model stacks them (`sage_infer.models.moe`). A model's ``checkpoint_combine``
may turn tensors into others first: gpt-oss's MXFP4 experts (blocks and scales) become its float expert weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from sage_infer.layers.quant_linear import QuantLinear
from sage_infer.layers.rotary import inv_frequencies
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.model_dir import (  # noqa: F401 - where the rest of the package finds them
    DEMO_DRAFT_DIR,
    DEMO_MODEL_DIR,
    ModelLoadError,
    read_config,
    resolve_model_dir,
)
from sage_infer.models.registry import (
    MXFP4_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    build_model,
    unsupported_architecture,
)
from sage_infer.quantization import mxfp4
from sage_infer.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    ConfigGroup,
    FormatError,
    decode_weight,
    parse_config,
)


def arch_config(directory: Path) -> ArchConfig:
    config = read_config(directory)
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{directory / 'config.json'}: {unsupported_architecture(arch)}")
    try:
        return ArchConfig.from_hf(config, arch)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{directory / 'config.json'}: missing or bad field: {err}") from None


def quantization_of(directory: Path) -> CompressedTensorsConfig | None:
    """The checkpoint's weight quantization (None for an unquantized one, and for MXFP4 experts, which the model
    dequantizes as they load: `sage_infer.quantization.mxfp4`); ModelLoadError naming
    ``config.json: quantization_config.<field>`` for anything sage cannot run."""
    config = read_config(directory)
    if "quantization_config" not in config:
        return None
    qc = config["quantization_config"]
    try:
        if isinstance(qc, dict) and qc.get("quant_method") == mxfp4.QUANT_METHOD:
            mxfp4.check_config(qc, (config.get("architectures") or [None])[0], MXFP4_ARCHITECTURES)
            return None
        return parse_config(qc)
    except (FormatError, ValueError) as err:
        raise ModelLoadError(f"{directory / 'config.json'}: {err}") from None


def keeps_mxfp4(directory: Path, device: str | torch.device) -> bool:
    """Whether an MXFP4 checkpoint's experts stay MXFP4 in memory, run by the grouped-experts kernel on the CPU:
    unless its config asks ``quantization_config.dequantize: true``, the model is on another device, or the CPU
    kernels are not built here (then they are dequantized as they load)."""
    from sage_infer.layers import cpu_kernels

    qc = read_config(directory).get("quantization_config")
    return (isinstance(qc, dict) and qc.get("quant_method") == mxfp4.QUANT_METHOD and not qc.get("dequantize")
            and torch.device(device).type == "cpu" and cpu_kernels.moe_experts_unavailable() is None)


def quantized_linears(model: nn.Module, quant: CompressedTensorsConfig | None) -> dict[str, ConfigGroup]:
    """Module name -> config group, for every nn.Linear of `model` the checkpoint stores quantized."""
    if quant is None:
        return {}
    return {name: group for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and (group := quant.scheme_for(name)) is not None}


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as err:
            raise ModelLoadError(f"{index}: cannot read the shard index: {err}") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{file}: shard listed in {index.name} is missing")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{single}: not found (no *.safetensors weights in {directory})")
    return files


def weight_elements(files: list[Path]) -> int:
    """Elements of every tensor in `files`, read from the safetensors headers alone (no weight is loaded)."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    total += math.prod(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: cannot read the safetensors header: {err}") from None
    return total


def load_weights(model: nn.Module, files: list[Path], tied: bool,
                 quantized: dict[str, ConfigGroup] | None = None) -> None:
    """Copy the checkpoint's tensors into `model`; the linears named in `quantized` (their weight
    parameter removed beforehand) become `QuantLinear` from their compressed tensors."""
    from safetensors import SafetensorError, safe_open

    quantized = quantized or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    rename = getattr(model, "checkpoint_rename", lambda name: name)
    combine = getattr(model, "checkpoint_combine", lambda name, tensor: [(name, tensor)])
    loaded: set[str] = set()
    compressed: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in quantized}
    filled: dict[str, int] = {}  # elements of a parameter stacked from several tensors (MoE experts) copied so far
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for stored in handle.keys():
                    if "rotary_emb.inv_freq" in stored:
                        continue
                    name = rename(stored)
                    prefix, _, suffix = name.rpartition(".")
                    if prefix in compressed and name not in params:  # weight_packed, weight_scale, ...; not bias
                        compressed[prefix][suffix] = handle.get_tensor(stored)
                        continue
                    for target, tensor in combine(name, handle.get_tensor(stored)):  # MXFP4: one of a pair
                        _copy_tensor(model, params, file, target, tensor, loaded, filled)
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: cannot read safetensors: {err}") from None
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    missing += [f"{prefix}.weight_scale" for prefix, tensors in compressed.items() if not tensors]
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        raise ModelLoadError(f"{files[0].parent}: weights missing from the checkpoint: {shown}")
    for prefix, tensors in compressed.items():
        linear = model.get_submodule(prefix)
        try:
            qw = decode_weight(tensors, quantized[prefix], (linear.out_features, linear.in_features), prefix)
        except FormatError as err:
            raise ModelLoadError(f"{files[0].parent}: {err}") from None
        device = linear.bias.device if linear.bias is not None else next(model.parameters()).device
        qw = type(qw)(qw.qweight.to(device), qw.scale.to(device),
                      None if qw.zero_point is None else qw.zero_point.to(device), qw.scheme)
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(qw, None if linear.bias is None else linear.bias.detach()))


def _copy_tensor(model: nn.Module, params: dict[str, nn.Parameter], file: Path, name: str, tensor: torch.Tensor,
                 loaded: set[str], filled: dict[str, int]) -> None:
    """Copy checkpoint tensor `name` (as the model's ``checkpoint_rename`` names it) into its parameter: the one
    of that name, else where the model's ``checkpoint_target`` puts it (one expert's rows of a stacked expert
    weight, which counts as loaded once every element of it was copied)."""
    target, index = name, None
    if name not in params:
        rule = getattr(model, "checkpoint_target", None)
        found = rule(name) if rule is not None else None
        if found is None or found[0] not in params:
            raise ModelLoadError(f"{file}: unexpected tensor {name!r} for this architecture")
        target, index = found
    dest = params[target] if index is None else params[target][index]
    if tensor.shape != dest.shape:
        raise ModelLoadError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
    if index is None:
        loaded.add(target)
        return
    filled[target] = filled.get(target, 0) + tensor.numel()
    if filled[target] == params[target].numel():
        loaded.add(target)


def stored_names(model: nn.Module, files: list[Path]) -> set[str]:
    """The names of the tensors in `files`, as `model` names them (``checkpoint_rename``), from the headers."""
    from safetensors import SafetensorError, safe_open

    rename = getattr(model, "checkpoint_rename", lambda name: name)
    names: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names.update(rename(name) for name in handle.keys())
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: cannot read the safetensors header: {err}") from None
    return names


def moe_quantized_linears(model: nn.Module, files: list[Path], quant: CompressedTensorsConfig) -> dict[str,
                                                                                                        ConfigGroup]:
    """An MoE model's quantized linears: those quantization_config targets that the checkpoint stores quantized
    (its routers match a "Linear" target but are kept float). Experts stored quantized each become their own
    linears first (`separate_experts`), loaded as any quantized linear is."""
    names = stored_names(model, files)
    if any(".experts." in name and name.endswith(".weight_scale") for name in names):
        model.separate_experts()
    return {prefix: group for prefix, group in quantized_linears(model, quant).items()
            if f"{prefix}.weight_scale" in names}


def load_model(
    path: str | Path | None, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[nn.Module, ArchConfig, Path]:
    """Build the architecture named in config.json on `device` and load its weights."""
    directory = resolve_model_dir(path)
    cfg = arch_config(directory)
    quant = quantization_of(directory)
    dtype = dtype or cfg.torch_dtype
    files = weight_files(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    if quant is not None and getattr(model, "is_moe", False):
        quantized = moe_quantized_linears(model, files, quant)
    else:
        quantized = quantized_linears(model, quant)
    if cfg.tie_word_embeddings and "lm_head" in quantized:
        raise ModelLoadError(f"{directory / 'config.json'}: quantization_config quantizes lm_head, which this "
                             f"model ties to its embeddings (add lm_head to quantization_config.ignore)")
    for prefix in quantized:  # never allocate the full-precision weight a quantized linear replaces
        linear = model.get_submodule(prefix)
        del linear.weight
        linear.register_parameter("weight", None)
    if keeps_mxfp4(directory, device):  # the experts' MXFP4 tensors load as they are: no float experts allocated
        model.keep_mxfp4()
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty materializes shared parameters separately: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.rotary_emb
    rotary.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope, cfg.max_position_embeddings).to(device)
    load_weights(model, files, cfg.tie_word_embeddings, quantized)
    return model.eval(), cfg, directory
