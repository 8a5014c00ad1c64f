"""KV runtime: the paged KV pool and the ref-counted blocks on top of it.

`BlockManager` needs no torch; `KVPool` (which does) is imported lazily, so importing
the block manager stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sage_infer.kv_runtime.block_manager import BlockInfo, BlockManager, BlockState, NoFreeBlocksError

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool, KVPoolSizeError, make_kv_pool

__all__ = [
    "BlockInfo",
    "BlockManager",
    "BlockState",
    "KVPool",
    "KVPoolSizeError",
    "NoFreeBlocksError",
    "make_kv_pool",
]

_LAZY = {"KVPool", "KVPoolSizeError", "make_kv_pool"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from sage_infer.kv_runtime import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
