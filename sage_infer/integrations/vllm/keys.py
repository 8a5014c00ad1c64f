"""Store keys of vLLM's KV blocks: sage's chained block hashes under a vLLM layout name.

A key is `prefix_reuse.hashing.hash_block` over (parent key, the block's token ids, extra
key), and the extra key covers model id, revision, KV dtype, *layout* and the request's
`cache_salt`. The layout string names vLLM's CPU cache layout, block size and parallel
layout, so a block written by vLLM is only ever found by a vLLM with the same layout:
sage's native engine (layout ``NHD``) computes other keys for the same tokens and never
reads these bytes (the byte layouts differ: see docs/vllm_connector.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.prefix_reuse.hashing import hash_block, make_extra_key

# vLLM CPU attention: one [num_blocks, num_kv_heads, block_size, 2 * head_size] tensor per layer,
# K then V inside each (block, head) tile
VLLM_CPU_LAYOUT = "vllm-cpu-NHD2"


def vllm_layout(block_size: int, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> str:
    """The layout part of the extra key, e.g. ``vllm-cpu-NHD2/bs128/tp1pp1``."""
    return f"{VLLM_CPU_LAYOUT}/bs{block_size}/tp{tensor_parallel}pp{pipeline_parallel}"


@dataclass(slots=True)
class KeySpace:
    """Everything but tokens and salt that names a block; hands out one extra key per salt."""

    model_id: str
    revision: str
    kv_dtype: str
    layout: str
    _extra: dict[str | None, bytes] = field(default_factory=dict, repr=False)

    def extra_key(self, cache_salt: str | None) -> bytes:
        key = self._extra.get(cache_salt)
        if key is None:
            if len(self._extra) > 4096:  # salts are per tenant; bound the memo all the same
                self._extra.clear()
            key = self._extra[cache_salt] = make_extra_key(
                self.model_id, self.revision, self.kv_dtype, self.layout, cache_salt
            )
        return key


def extend_chain(
    keys: list[bytes], token_ids: Sequence[int], num_blocks: int, block_size: int, extra_key: bytes
) -> list[bytes]:
    """Append the keys of blocks ``len(keys) .. num_blocks-1`` of `token_ids` to `keys` (in place).

    `token_ids` must hold at least ``num_blocks * block_size`` tokens. Returns `keys`.
    """
    if len(token_ids) < num_blocks * block_size:
        raise ValueError(f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} tokens, "
                         f"got {len(token_ids)}")
    parent = keys[-1] if keys else None
    for i in range(len(keys), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        keys.append(parent)
    return keys
