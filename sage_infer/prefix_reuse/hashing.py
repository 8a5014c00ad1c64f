"""Chained block hashes: the names under which KV blocks are found again.

A block's hash covers its parent's hash, its token ids and an *extra key* (model,
revision, KV dtype/layout, tenant salt), so equal hashes mean equal KV. The bytes fed to
sha256 are a fixed, length-prefixed little-endian encoding: the same block hashes the
same in every process and on every host (no Python `hash()`, no seed), which lets one
instance or tier find a block another one wrote.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

HASH_BYTES = 32  # full sha256 digest
_DOMAIN = b"sage-kv-block/v1"
_EXTRA_DOMAIN = b"sage-kv-extra/v1"
_LEN = struct.Struct("<q")  # every variable-length field is preceded by its length


def _field(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def _text(value: object) -> str:
    """Enum members (e.g. `KVDtype.BF16`) hash by value, so `"bf16"` and `KVDtype.BF16` agree."""
    return str(getattr(value, "value", value))


def make_extra_key(
    model_id: str, revision: str, kv_dtype: str, layout: str = "NHD", cache_salt: str | None = None
) -> bytes:
    """Everything besides tokens that decides a block's KV, as a 32-byte digest.

    `cache_salt` isolates tenants: blocks hashed under different salts never match. A
    missing salt and an empty salt are different keys.
    """
    parts = [_EXTRA_DOMAIN]
    for value in (model_id, revision, kv_dtype, layout):
        parts.append(_field(_text(value).encode("utf-8")))
    if cache_salt is None:
        parts.append(_LEN.pack(-1))
    else:
        parts.append(_field(cache_salt.encode("utf-8")))
    return hashlib.sha256(b"".join(parts)).digest()


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """One engine's `make_extra_key`: its model, revision, KV dtype and layout fixed; called with a request's
    `cache_salt` (and, to convert KV for another engine, another `kv_dtype`)."""

    model_id: str
    revision: str
    kv_dtype: str
    layout: str = "NHD"

    def __call__(self, cache_salt: str | None = None, kv_dtype: str | None = None) -> bytes:
        return make_extra_key(self.model_id, self.revision, kv_dtype or self.kv_dtype, self.layout, cache_salt)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes) -> bytes:
    """sha256 of (parent hash, extra key, token ids) -> 32 bytes.

    Encoding: domain tag, then parent (length -1 for the first block of a sequence),
    extra key, and the token count followed by the ids packed as little-endian int64.
    """
    n = len(token_ids)
    try:
        tokens = struct.pack(f"<{n}q", *token_ids)
    except struct.error as err:
        raise ValueError(f"token ids must be integers in int64 range: {err}") from None
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_LEN.pack(-1) if parent is None else _field(parent))
    digest.update(_field(extra_key))
    digest.update(_LEN.pack(n))
    digest.update(tokens)
    return digest.digest()


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, extra_key: bytes, parent: bytes | None = None
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block has none).

    `parent` continues a chain (the hash of the block before `token_ids[0]`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes


def extend_chain(
    chain: list[bytes], token_ids: Sequence[int], block_size: int, extra_key: bytes, num_blocks: int
) -> list[bytes]:
    """Grow `chain` (the hashes of `token_ids`' leading full blocks, computed so far) in place to `num_blocks`
    hashes and return its first `num_blocks`. The caller keeps the list, so each block is hashed once however
    often it is asked for (a waiting request is matched every step)."""
    for i in range(len(chain), num_blocks):
        chain.append(hash_block(chain[-1] if chain else None, token_ids[i * block_size : (i + 1) * block_size],
                                extra_key))
    return chain[:num_blocks]


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes) -> list[bytes]:
    """The hashes of the prompt blocks a prefix hit could cover: every full block before the prompt's last token
    (that token is always computed, for its logits)."""
    usable = (len(token_ids) - 1) // block_size * block_size
    return hash_token_blocks(token_ids[:usable], block_size, extra_key)

