"""Least frequently used, ties broken by least recent use, plus `LeafHeap`, the priority
structure the heap-ordered policies (LFU, cost/PGDSF, OPT) share.

Only leaves of the prefix tree can be evicted, so `LeafHeap` tracks the tree from
`on_insert(parent=...)` / `on_remove` and keeps only leaves as candidates: an inner block
joins the heap when its last child leaves. `victim` then only ever steps past keys that
are evictable now: keys requests hold (`hold` .. `unhold`, from the policies' `on_use` and
`on_release`) leave the heap meanwhile, since a full pool's running requests hold most of it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count

from sage_infer.kv_policy.base import EvictionPolicy, register_policy

Priority = tuple[float, ...]


class LeafHeap:
    """Min-heap of `(priority, key)` over the leaf keys of a prefix tree, with lazy deletion.

    `prio` holds every tracked key's current priority; a heap entry is live while it
    matches `prio` and its key has no tracked children and is not held. Updates push a new entry and
    leave the old one to be discarded when it reaches the top; the heap is rebuilt once
    it holds more than twice as many entries as keys.
    """

    __slots__ = ("prio", "parent", "children", "heap", "held")

    def __init__(self) -> None:
        self.prio: dict[bytes, Priority] = {}
        self.parent: dict[bytes, bytes | None] = {}
        self.children: dict[bytes, int] = {}  # only keys with at least one tracked child
        self.heap: list[tuple[Priority, bytes]] = []
        self.held: set[bytes] = set()  # keys requests hold: no candidates until released

    def __len__(self) -> int:
        return len(self.prio)

    def __contains__(self, key: object) -> bool:
        return key in self.prio

    def add(self, key: bytes, prio: Priority, parent: bytes | None) -> None:
        """Track a new key under `parent` (an untracked parent counts as none)."""
        if key in self.prio:
            self.update(key, prio)
            return
        if parent is not None and parent not in self.prio:
            parent = None
        self.prio[key] = prio
        self.parent[key] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        self._push(key, prio)

    def update(self, key: bytes, prio: Priority) -> None:
        self.prio[key] = prio
        if key not in self.children and key not in self.held:
            self._push(key, prio)

    def hold(self, key: bytes) -> None:
        """A request holds `key`: it leaves the candidates (its heap entries go stale) until `unhold`."""
        if key in self.prio:
            self.held.add(key)

    def unhold(self, key: bytes) -> None:
        if key in self.held:
            self.held.remove(key)
            if key not in self.children:
                self._push(key, self.prio[key])

    def remove(self, key: bytes) -> Priority:
        """Forget `key`; its parent becomes a candidate when this was its last child."""
        prio = self.prio.pop(key)
        parent = self.parent.pop(key)
        self.children.pop(key, None)
        self.held.discard(key)
        if parent is not None:
            left = self.children[parent] - 1
            if left:
                self.children[parent] = left
            else:
                del self.children[parent]
                if parent not in self.held:
                    self._push(parent, self.prio[parent])
        return prio

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The lowest-priority evictable leaf; entries of non-evictable keys are set aside and pushed back."""
        heap, prio, children, held = self.heap, self.prio, self.children, self.held
        aside: list[tuple[Priority, bytes]] = []
        found = None
        while heap:
            entry_prio, key = heap[0]
            if prio.get(key) != entry_prio or key in children or key in held:
                heapq.heappop(heap)  # stale: updated since, removed, no longer a leaf, or held (`unhold` pushes)
            elif evictable(key):
                found = key
                break
            else:
                aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _push(self, key: bytes, prio: Priority) -> None:
        heapq.heappush(self.heap, (prio, key))
        if len(self.heap) > 2 * len(self.prio) + 1024:
            self.heap = [(p, k) for k, p in self.prio.items() if k not in self.children and k not in self.held]
            heapq.heapify(self.heap)


@register_policy("lfu")
class LFUPolicy(EvictionPolicy):
    """Least frequently used (in-cache LFU): evicts the evictable leaf with the fewest uses.

    A block's count starts at 1 on insert and grows by one per hit; it is forgotten on
    eviction. Ties go to the least recently used block, where, as in LRU, insert, hit and
    release all count as a use. O(log n) per operation through `LeafHeap`.
    """

    __slots__ = ("_heap", "_clock")

    def __init__(self) -> None:
        self._heap = LeafHeap()
        self._clock = count()

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        self._heap.add(key, (1, next(self._clock)), parent)

    def on_hit(self, key: bytes) -> None:
        self._heap.update(key, (self._heap.prio[key][0] + 1, next(self._clock)))

    def on_use(self, key: bytes) -> None:
        self._heap.hold(key)

    def on_release(self, key: bytes) -> None:
        self._heap.held.discard(key)  # (the update pushes it back)
        self._heap.update(key, (self._heap.prio[key][0], next(self._clock)))

    def on_remove(self, key: bytes) -> None:
        self._heap.remove(key)

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        return self._heap.victim(evictable)

    def frequency(self, key: bytes) -> int:
        """Uses of a cached block: 1 for its insert plus one per hit."""
        return int(self._heap.prio[key][0])

    def __len__(self) -> int:
        return len(self._heap)
