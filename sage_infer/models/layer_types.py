"""Which layers attend through a sliding window, read from a Hugging Face ``config.json`` the way each family's
transformers code reads it:

- ``layer_types`` (a list of ``"sliding_attention"`` / ``"full_attention"``, one per layer) when the config has it;
- else Qwen2/Qwen3 (and their MoE variants): ``use_sliding_window`` with ``max_window_layers`` (layer ``i`` slides
  when ``i >= max_window_layers``); Gemma 2 and gpt-oss: every other layer, the first one sliding; Gemma 3: all but
  every ``sliding_window_pattern``-th layer (default 6); Mistral and Mixtral: every layer;
- a family whose transformers code ignores ``sliding_window`` (Llama) ignores it here too.

A window applies only where ``sliding_window`` is set (Qwen: and ``use_sliding_window`` is true). Mistral and
Mixtral's transformers code applies ``sliding_window`` to every layer whatever ``layer_types`` says.
"""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
UNIFORM_WINDOW_FAMILIES = ("Mistral", "Mixtral")  # transformers windows every layer of these
QWEN_FAMILIES = ("Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe")


def sliding_window_of(config: dict, family: str) -> int | None:
    """The window in keys a sliding layer's query sees (its own included), or None when no layer slides."""
    window = config.get("sliding_window")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: true is not built (every layer here attends causally)")
    if family in QWEN_FAMILIES and not config.get("use_sliding_window", False):
        return None
    if family not in UNIFORM_WINDOW_FAMILIES + QWEN_FAMILIES + ("GptOss",) and not family.startswith("Gemma") \
            and "layer_types" not in config:
        return None
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window: {window} (a window holds at least one key)")
    return int(window) if window else None


def layer_types_of(config: dict, family: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention type, ``"sliding_attention"`` or ``"full_attention"`` (a layer of a model without a
    window is full whatever its type says: see `sliding_window_of`)."""
    if family in UNIFORM_WINDOW_FAMILIES:
        return (SLIDING,) * num_layers
    types = config.get("layer_types")
    if types is not None:
        types = tuple(types)
        if len(types) != num_layers:
            raise ValueError(f"layer_types: {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown:
            raise ValueError(f"layer_types: {', '.join(map(repr, unknown))} is not built (this engine runs "
                             f"{SLIDING!r} and {FULL!r} layers)")
        return types
    if family in QWEN_FAMILIES:
        first = int(config.get("max_window_layers", num_layers))
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    if family in ("Gemma2", "GptOss"):
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    if family == "Gemma3":
        pattern = int(config.get("sliding_window_pattern", 6))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    return (SLIDING,) * num_layers


def layer_windows(config: dict, family: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention)."""
    window = sliding_window_of(config, family)
    types = layer_types_of(config, family, num_layers)
    return tuple(window if window is not None and kind == SLIDING else None for kind in types)


def rope_by_layer_type(config: dict) -> tuple[dict, dict | None]:
    """(the full-attention layers' rope parameters, the sliding layers' when they differ: Gemma 3's
    ``rope_local_base_freq``, or transformers 5's ``rope_parameters`` keyed by layer type; else None)."""
    from sage_infer.layers.rotary import rope_parameters

    nested = config.get("rope_parameters") or {}
    if FULL in nested or SLIDING in nested:
        full = rope_parameters({"rope_parameters": nested.get(FULL) or {"rope_theta": 1_000_000.0}})
        return full, rope_parameters({"rope_parameters": nested.get(SLIDING) or {"rope_theta": 10_000.0}})
    if "rope_local_base_freq" in config:
        return rope_parameters(config), {"rope_type": "default", "rope_theta": float(config["rope_local_base_freq"])}
    return rope_parameters(config), None
