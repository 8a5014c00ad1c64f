"""KV tier stores: whole KV blocks below the device pool (host DRAM, local disk, Redis, Mooncake Store).

Every store speaks `KVTier` (see `base.py`). The stores import lazily, so
``import sage_infer.kv_runtime.tiers`` pulls in neither torch-heavy slabs nor the redis or mooncake clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError, TierError

if TYPE_CHECKING:
    from sage_infer.kv_runtime.tiers.base import KVTier, TierStats, schema_digest
    from sage_infer.kv_runtime.tiers.disk import DiskTier
    from sage_infer.kv_runtime.tiers.host import HostTier
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier
    from sage_infer.kv_runtime.tiers.redis import RedisTier

__all__ = [
    "DiskTier", "HostTier", "KVTier", "MooncakeTier", "RedisTier", "TierConfigError", "TierError", "TierStats",
    "schema_digest",
]

_LAZY = {
    "KVTier": "base",
    "TierStats": "base",
    "schema_digest": "base",
    "HostTier": "host",
    "DiskTier": "disk",
    "RedisTier": "redis",
    "MooncakeTier": "mooncake",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
