"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023).

Three FIFO queues: a small queue S (10% of the capacity) that new blocks enter, a main
queue M (the rest), and a ghost queue G holding the keys (no data) of blocks recently
evicted from S, as many as M can hold. Each live block has a 2-bit hit counter (0..3).

* Insert: into M when the key is in G (it was evicted too early), else into S.
* Evict from S (when |S| >= 10% of the cache): the oldest block moves to M, bits
  cleared, if it was hit while in S; otherwise it is evicted and its key enters G. So
  one-hit wonders leave from S without ever touching M.
* Evict from M: the oldest block with a non-zero counter is reinserted at the head
  with the counter decremented; the first with counter 0 is evicted.

Adaptations to externally driven eviction (`victim` names one key, the caller removes
it): moving blocks S -> M and reinserting inside M happen in `victim`, since they keep
the block cached. A promotion that overfills M hands the eviction to M, as the paper's
evictS -> evictM does. Blocks that are not evictable are
passed over: left in place in S, reinserted without decrement in M. A block takes its
FIFO position when first released (when it becomes evictable), so a chain released
leaf-first queues its leaves ahead of its parents. Blocks requests hold (`on_use` ..
`on_release`) leave their queue meanwhile (still counted in its size) and rejoin it at the
newest end when released, as a new block would: a full pool's running requests hold most of
its blocks, and passing over them made each eviction cost time in the pool's size. With
`capacity` None the live block count stands in for the capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from sage_infer.kv_policy.base import EvictionPolicy, HeldKeys, register_policy

MAX_FREQ = 3  # two bits
SMALL_RATIO = 0.1


@register_policy("s3fifo")
class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: small probationary FIFO, main FIFO with 2-bit reinsertion, ghost FIFO."""

    __slots__ = ("capacity", "_small", "_main", "_ghost", "_freq", "_fresh", "_held")
    uses_capacity = True

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"S3-FIFO capacity must be at least one block, got {capacity}")
        self.capacity = capacity
        self._small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._fresh: set[bytes] = set()  # inserted, not yet released
        self._held = HeldKeys()  # first: S, second: M

    @property
    def small_target(self) -> int:
        c = self.capacity if self.capacity is not None else len(self)
        return max(1, round(SMALL_RATIO * c))

    @property
    def main_size(self) -> int:
        """M's share of the cache; G holds as many keys."""
        c = self.capacity if self.capacity is not None else len(self)
        return max(1, c - self.small_target)

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        if key in self._freq:
            self.on_hit(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0
        self._fresh.add(key)

    def on_hit(self, key: bytes) -> None:
        self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def on_use(self, key: bytes) -> None:
        self._held.take(key, self._small, self._main)

    def on_release(self, key: bytes) -> None:
        in_small = self._held.pop(key)
        if in_small is not None:
            self._fresh.discard(key)
            (self._small if in_small else self._main)[key] = None
        elif key in self._fresh:
            self._fresh.discard(key)
            (self._small if key in self._small else self._main).move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        del self._freq[key]
        self._fresh.discard(key)
        in_small = self._held.pop(key)
        if in_small or key in self._small:
            self._small.pop(key, None)
            self._ghost[key] = None
            while len(self._ghost) > self.main_size:
                self._ghost.popitem(last=False)
        elif in_small is None:
            del self._main[key]

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        found = None
        if len(self._small) + self._held.in_first >= self.small_target or not self._main_size():
            found = self._evict_small(evictable)
        if found is None:
            found = self._evict_main(evictable)
        if found is None:  # M has nothing evictable: any evictable block of S
            found = next((key for key in self._small if evictable(key)), None)
        return found

    def _evict_small(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        small, freq = self._small, self._freq
        passed: list[bytes] = []
        found = None
        main, main_size = self._main, self.main_size
        for _ in range(len(small)):  # each step promotes, evicts or passes over one key
            key = next(iter(small))
            if freq[key] > 0:  # hit while in S: promote to M, bits cleared
                del small[key]
                main[key] = None
                freq[key] = 0
                if len(main) + self._held.in_second > main_size:
                    break  # M is full: it evicts instead (evictS -> evictM)
            elif evictable(key):
                found = key
                break
            else:
                passed.append(key)
                small.move_to_end(key)
        for key in reversed(passed):  # passed-over keys keep their place at the old end
            small.move_to_end(key, last=False)
        return found

    def _evict_main(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        main, freq = self._main, self._freq
        passes = 0  # consecutive keys passed over for not being evictable
        while main and passes < len(main):
            key = next(iter(main))
            if freq[key] > 0:
                freq[key] -= 1
                main.move_to_end(key)
                passes = 0
            elif evictable(key):
                return key
            else:
                main.move_to_end(key)
                passes += 1
        return None

    def _main_size(self) -> int:
        return len(self._main) + self._held.in_second

    def queues(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """S, M, G, each from oldest to newest (the held blocks last in theirs, in no order)."""
        small, main = [*self._small, *self._held.keys(first=True)], [*self._main, *self._held.keys(first=False)]
        return small, main, list(self._ghost)

    def frequency(self, key: bytes) -> int:
        return self._freq[key]

    def __len__(self) -> int:
        return len(self._freq)
