"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from sage_infer.kv_policy.base import EvictionPolicy, register_policy


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted, hit or released block that is evictable.

    An OrderedDict keeps keys from least to most recent; `victim` scans from the least
    recent end and skips keys that are not evictable (inner nodes of the prefix tree). Blocks
    requests hold (`on_use` .. `on_release`) wait outside that order, since a release makes
    them the most recent anyway: a full pool's running requests hold most of its blocks, and
    scanning past them made each eviction cost time in the pool's size.
    """

    __slots__ = ("_order", "_held")

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self._held: set[bytes] = set()

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: bytes) -> None:
        if key not in self._held:
            self._order.move_to_end(key)

    def on_use(self, key: bytes) -> None:
        if self._order.pop(key, self) is not self:
            self._held.add(key)

    def on_release(self, key: bytes) -> None:
        if key in self._held:
            self._held.remove(key)
            self._order[key] = None  # (a new key: the most recent end)
        else:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        if key in self._held:
            self._held.remove(key)
        else:
            del self._order[key]

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used (the held ones last, in no order)."""
        return [*self._order, *self._held]

    def __len__(self) -> int:
        return len(self._order) + len(self._held)
