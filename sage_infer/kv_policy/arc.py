"""Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead
Replacement Cache", FAST 2003).

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1 and B2 are ghost
lists (keys only) of blocks recently evicted from T1 and T2. A ghost hit in B1 means T1
was too small, so the target size `p` of T1 grows; a ghost hit in B2 shrinks it.

Adaptations to a cache whose evictions are driven from outside (`victim` is asked only
when the pool needs a block, and then the caller removes the key):

* REPLACE happens in `victim`: T1's LRU end is preferred when |T1| > p, else T2's; keys
  that are not evictable (in use, or inner nodes of the prefix tree) are skipped, and
  when the preferred list has no evictable key the other list is used.
* `on_remove` moves the evicted key to the ghost list of the list it left; ghosts are
  trimmed to |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (cases IV.A/B).
* `on_release` refreshes a block's recency inside its list without promoting it, so a
  chain released leaf-first keeps parents more recent than their children.
* Blocks requests hold (`on_use` .. `on_release`) wait outside T1 and T2 (counted in their
  list's size), since their release puts them at their list's MRU end anyway: `victim`
  then never walks past the blocks of running requests, which fill most of a busy pool.
* With `capacity` None, c follows the number of live blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from sage_infer.kv_policy.base import EvictionPolicy, HeldKeys, register_policy


@register_policy("arc")
class ARCPolicy(EvictionPolicy):
    """ARC with T1/T2 (live) and B1/B2 (ghost) LRU lists and an adaptive T1 target `p`."""

    __slots__ = ("capacity", "p", "_t1", "_t2", "_b1", "_b2", "_held")
    uses_capacity = True

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"ARC capacity must be at least one block, got {capacity}")
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._held = HeldKeys()  # first: T1, second: T2

    def _n1(self) -> int:
        return len(self._t1) + self._held.in_first

    @property
    def c(self) -> int:
        """The cache size ARC adapts to: `capacity`, or the live block count when none was given."""
        return self.capacity if self.capacity is not None else max(1, len(self))

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        if key in self._t1 or key in self._t2 or key in self._held:
            self.on_hit(key)
            return
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:  # case II: T1 was too small
            self.p = min(float(self.c), self.p + max(b2 / b1, 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:  # case III: T2 was too small
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:  # case IV: a new block
            self._t1[key] = None
        self._trim_ghosts()

    def on_hit(self, key: bytes) -> None:  # case I
        if key in self._held:
            self._held.to_second(key)
        elif key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def on_use(self, key: bytes) -> None:
        self._held.take(key, self._t1, self._t2)

    def on_release(self, key: bytes) -> None:
        in_t1 = self._held.pop(key)
        if in_t1 is not None:
            (self._t1 if in_t1 else self._t2)[key] = None
        else:
            (self._t1 if key in self._t1 else self._t2).move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        in_t1 = self._held.pop(key)
        if in_t1 is not None:
            (self._b1 if in_t1 else self._b2)[key] = None
        elif key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        n1 = self._n1()
        first, second = (self._t1, self._t2) if n1 and n1 > self.p else (self._t2, self._t1)
        for keys in (first, second):
            for key in keys:
                if evictable(key):
                    return key
        return None

    def _trim_ghosts(self) -> None:
        c = self.c
        while self._b1 and self._n1() + len(self._b1) > c:
            self._b1.popitem(last=False)
        total = len(self) + len(self._b1) + len(self._b2)
        while total > 2 * c and (self._b2 or self._b1):
            (self._b2 if self._b2 else self._b1).popitem(last=False)
            total -= 1

    def lists(self) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
        """T1, T2, B1, B2, each from LRU to MRU (the held blocks last in theirs, in no order)."""
        t1, t2 = [*self._t1, *self._held.keys(first=True)], [*self._t2, *self._held.keys(first=False)]
        return t1, t2, list(self._b1), list(self._b2)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._held)
