"""What a model's KV groups hold, read from its config.json alone (no weights): `sage config show` prints it."""

from __future__ import annotations

from sage_infer.config.serve import ServeConfig
from sage_infer.core.dtypes import DTYPE_NAMES
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime.kv_groups import kv_groups
from sage_infer.models.loader import arch_config
from sage_infer.models.model_dir import ModelLoadError, resolve_model_dir


def kv_group_rows(config: ServeConfig) -> tuple[str, list[dict], dict] | None:
    """(the KV dtype counted, one row per KV group: kind, layers, bytes a token takes, tokens one GiB of the pool holds
    in it, tokens a sequence keeps there at most; and what a sequence at the model's context keeps: its tokens, its
    KV bytes, and those of every layer keeping every token) for `config`'s model; None when its directory cannot be
    read (the bundled demo model when no path is set). ``kv_dtype: auto`` counts the model's dtype."""
    try:
        arch = arch_config(resolve_model_dir(config.model.path))
    except (ModelLoadError, ValueError):
        return None
    dtype = config.kv_pool.kv_dtype
    if dtype == "auto":
        dtype = KVDtype(DTYPE_NAMES.get(arch.torch_dtype, "bf16"))
    groups = kv_groups(arch.layer_windows or (None,) * arch.num_layers)
    schema = KVCacheSchema(groups.layers_per_block, arch.num_kv_heads, arch.head_dim,
                           config.kv_pool.block_size).with_dtype(dtype)
    tokens = config.model.max_model_len or arch.max_position_embeddings
    per_block, bs = schema.bytes_per_block, schema.block_size
    every_layer = -(-tokens // bs) * per_block * arch.num_layers // groups.layers_per_block
    sequence = {"tokens": tokens, "bytes": groups.sequence_blocks(tokens, bs) * per_block,
                "full_attention_bytes": every_layer}
    return dtype.value, groups.describe(per_block, bs), sequence
