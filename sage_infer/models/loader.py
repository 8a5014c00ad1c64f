"""Load a Hugging Face model directory from disk: config.json and safetensors weights
(single file or sharded with ``model.safetensors.index.json``). Never the network."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from sage_infer.errors import SageError
from sage_infer.layers.rotary import inv_frequencies
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.registry import SUPPORTED_ARCHITECTURES, build_model

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"


class ModelLoadError(SageError):
    """A model directory that cannot be loaded: the message names the file or architecture."""

    exit_code = 2


def resolve_model_dir(path: str | Path | None) -> Path:
    """The model directory to load: `path`, or the bundled demo model when None."""
    directory = DEMO_MODEL_DIR if path is None else Path(path).expanduser()
    if not directory.is_dir():
        what = "bundled demo model" if path is None else "model directory"
        raise ModelLoadError(f"{directory}: {what} not found (models are loaded from local directories only)")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory / 'config.json'}: not found; expected a Hugging Face model directory")
    return directory


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: cannot read: {err}") from None


def arch_config(directory: Path) -> ArchConfig:
    config = read_config(directory)
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{directory / 'config.json'}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        return ArchConfig.from_hf(config, arch)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{directory / 'config.json'}: missing or bad field: {err}") from None


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


def load_weights(model: nn.Module, files: list[Path], tied: bool) -> None:
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if "rotary_emb.inv_freq" in name:
                        continue
                    if name not in params:
                        raise ModelLoadError(f"{file}: unexpected tensor {name!r} for this architecture")
                    tensor = handle.get_tensor(name)
                    if tensor.shape != params[name].shape:
                        raise ModelLoadError(
                            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(params[name].shape)}"
                        )
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    loaded.add(name)
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"{file}: cannot read safetensors: {err}") from None
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        raise ModelLoadError(f"{files[0].parent}: weights missing from the checkpoint: {shown}")


def load_model(
    path: str | Path | None, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[nn.Module, ArchConfig, Path]:
    """Build the architecture named in config.json on `device` and load its weights."""
    directory = resolve_model_dir(path)
    cfg = arch_config(directory)
    dtype = dtype or cfg.torch_dtype
    files = weight_files(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty materializes shared parameters separately: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.rotary_emb
    rotary.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope, cfg.max_position_embeddings).to(device)
    load_weights(model, files, cfg.tie_word_embeddings)
    return model.eval(), cfg, directory
