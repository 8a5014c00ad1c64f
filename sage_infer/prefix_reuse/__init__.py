"""Prefix reuse: find the KV of a prompt's longest cached prefix by chained block hashes."""

from sage_infer.prefix_reuse.hashing import HASH_BYTES, hash_block, hash_token_blocks, make_extra_key
from sage_infer.prefix_reuse.index import EvictedBlock, PrefixMatch, PrefixReuseIndex
from sage_infer.prefix_reuse.metrics import PrefixReuseMetrics

__all__ = [
    "HASH_BYTES",
    "EvictedBlock",
    "PrefixMatch",
    "PrefixReuseIndex",
    "PrefixReuseMetrics",
    "hash_block",
    "hash_token_blocks",
    "make_extra_key",
]
