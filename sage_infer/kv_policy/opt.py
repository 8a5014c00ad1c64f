"""Belady's OPT (Belady, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal, 1966): evict the block whose next use is farthest in the
future. It needs the future, so it only runs in trace replay, as the upper bound online
policies are measured against.

`FutureIndex` holds, for every block key of a trace (the chained block hash, made exactly
as the replay makes it: `sage_infer.sim.opt.future_of`), the sorted request indices where it appears. The
replay calls `begin_request(i)` before each request; a key's next use is then the first
index after the request that last used it. Blocks never used again go first; ties go
to the deeper block, so children leave before their parents. Registered as "opt", but
`make_policy("opt")` raises: build it with `OPTPolicy(sim.opt.future_of(requests))`
or call `sim.opt.replay_opt`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from sage_infer.kv_policy.base import EvictionPolicy, register_policy
from sage_infer.kv_policy.lfu import LeafHeap

NEVER = float("inf")


@dataclass(slots=True)
class FutureIndex:
    """Block key -> sorted indices of the requests that use it."""

    uses: dict[bytes, list[int]]

    def next_use(self, key: bytes, after: int) -> float:
        """The first request index > `after` that uses `key`; `NEVER` if none."""
        indices = self.uses.get(key)
        if not indices:
            return NEVER
        pos = bisect_right(indices, after)
        return indices[pos] if pos < len(indices) else NEVER


@register_policy("opt")
class OPTPolicy(EvictionPolicy):
    """Belady's OPT over the evictable leaves: a max-heap on next use (lazy invalidation)."""

    __slots__ = ("future", "now", "_heap", "_depth")

    def __init__(self, future: FutureIndex | None = None) -> None:
        if future is None:
            raise ValueError("the 'opt' policy needs the trace's future: use sage_infer.sim.opt.replay_opt(requests, "
                             "capacity) or OPTPolicy(sage_infer.sim.opt.future_of(requests))")
        self.future = future
        self.now = -1  # index of the request being replayed
        self._heap = LeafHeap()  # min-heap on (-next use, -depth)
        self._depth: dict[bytes, int] = {}

    def begin_request(self, index: int) -> None:
        """The replay is about to run request `index`."""
        self.now = index

    def next_use(self, key: bytes) -> float:
        return self.future.next_use(key, self.now)

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        self._depth[key] = depth
        self._heap.add(key, (-self.next_use(key), -depth), parent)

    def on_hit(self, key: bytes) -> None:
        self._heap.update(key, (-self.next_use(key), -self._depth[key]))

    def on_use(self, key: bytes) -> None:
        self._heap.hold(key)

    def on_release(self, key: bytes) -> None:
        self._heap.unhold(key)

    def on_remove(self, key: bytes) -> None:
        self._heap.remove(key)
        del self._depth[key]

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        while True:
            key = self._heap.victim(evictable)
            if key is None or -self._heap.prio[key][0] > self.now:
                return key
            # its expected use passed without a hit (the engine drove it differently): re-aim
            self._heap.update(key, (-self.next_use(key), -self._depth[key]))

    def __len__(self) -> int:
        return len(self._depth)
