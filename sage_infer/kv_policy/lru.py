"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from sage_infer.kv_policy.base import EvictionPolicy, register_policy


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted, hit or released block that is evictable.

    An OrderedDict keeps keys from least to most recent; `victim` scans from the least
    recent end and skips keys that are not evictable (in use, or inner nodes of the
    prefix tree).
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def on_release(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        del self._order[key]

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)
