"""`sage`: a learned eviction policy (`policy.eviction: sage`; the default is `lru`). Evicts the
cached block with the lowest learned hit density among evictable leaves of the prefix tree.

Three parts:

1. *Admission by class* (probation / protected / ghost). A new block starts in a
   probationary class (never reused). Most blocks of real traffic are used once, and
   their class learns a low density past the typical return gap, so they go before any
   block that was reused; a reused block moves to a protected class (by reuse count,
   1, 2, 3+). A bounded ghost list remembers the reuse count of recently evicted blocks:
   a block that comes back after eviction is admitted straight into the protected
   classes, so one-hit wonders never push out a prefix that conversations return to.
2. *Prefix structure*. Only leaves are candidates (the index enforces it; the policy
   tracks child counts itself to sample among leaves only). When a request releases its
   chain, the deepest block (no child) is flagged as a chain *tail*: a prompt's last block
   is where the next turn diverges (new answer + message), so its reuse behaviour is
   learned separately from the inner blocks of the chain. A chain that is not extended
   ages as a whole and is trimmed leaf by leaf from its end.
3. *Reuse prediction*. `LifetimePredictor` learns, per class, the distribution of the
   gap between consecutive uses and of the age at eviction, and turns them into the
   expected hits per unit of cache space-time still to be spent on a block of that
   class and age (hit density). `victim` samples evictable leaves and evicts the one
   with the lowest density. A ghost hit is also fed back as the reuse the eviction cut
   short (`record_late_hit`), and every class is shrunk toward the pooled histograms, so
   a class evicted before any reuse could be seen is not written off for good.

Time is the clock given to `tick` (seconds); without ticks a logical clock (one unit per
insert or hit) is used. All sizes are fractions of the capacity; sampling uses a seeded
generator, so a replay is deterministic.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable

from sage_infer.kv_policy.base import EvictionPolicy, register_policy
from sage_infer.kv_policy.lifetime import LifetimePredictor

MAX_REUSE = 3  # reuse counts 0, 1, 2, 3+
MAX_TURN = 0  # turn buckets used in the class (0 = off: measured no better on Mooncake)
NUM_CLASSES = (MAX_REUSE + 1) * (MAX_TURN + 1) * 2  # x (inner block, chain tail)

# block state, a small list per key (fast to mutate)
_T, _REUSE, _TAIL, _CHILDREN, _PARENT, _TURN, _WAS_HIT = range(7)


def _class_of(meta: list) -> int:
    reuse = meta[_REUSE]
    turn = meta[_TURN]
    return (((reuse if reuse < MAX_REUSE else MAX_REUSE) * (MAX_TURN + 1) + (turn if turn < MAX_TURN else MAX_TURN))
            * 2 + meta[_TAIL])


@register_policy("sage")
class SagePolicy(EvictionPolicy):
    """Learned hit-density eviction over prefix-tree leaves, with ghost-list admission."""

    uses_capacity = True
    __slots__ = ("capacity", "samples", "predictor", "_meta", "_leaves", "_leaf_pos", "_ghost", "_ghost_cap",
                 "_now", "_ticked", "_events", "_refresh_every", "_next_refresh", "_random",
                 "_learn_late_hits")

    def __init__(self, capacity: int | None = None, *, samples: int = 16, ghost_fraction: float = 1.0,
                 prior: float = 8.0, learn_late_hits: bool = True, seed: int = 0) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least one block, got {capacity}")
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.capacity = capacity
        self.samples = samples
        self.predictor = LifetimePredictor(NUM_CLASSES, prior=prior)
        self._learn_late_hits = learn_late_hits
        self._meta: dict[bytes, list] = {}
        self._leaves: list[bytes] = []  # keys with no cached child, for O(1) sampling
        self._leaf_pos: dict[bytes, int] = {}
        self._ghost: OrderedDict[bytes, tuple] = OrderedDict()  # evicted key -> (class, last use, age, reuses, turn)
        self._ghost_cap = max(1, int((capacity or 1024) * ghost_fraction))
        self._now = 0.0
        self._ticked = False
        self._events = 0
        # refresh the density table about every half a cache turnover
        self._refresh_every = max(64, (capacity or 1024) // 2)
        self._next_refresh = self._refresh_every
        self._random = random.Random(seed)

    # --- clock ---

    def tick(self, now: float) -> None:
        if now > self._now or not self._ticked:
            self._now = float(now)
        self._ticked = True

    def _clock(self) -> float:
        return self._now if self._ticked else float(self._events)

    def _event(self) -> None:
        self._events += 1
        if self._events >= self._next_refresh:
            self._next_refresh = self._events + self._refresh_every
            self.predictor.refresh()

    # --- leaf set ---

    def _add_leaf(self, key: bytes) -> None:
        self._leaf_pos[key] = len(self._leaves)
        self._leaves.append(key)

    def _drop_leaf(self, key: bytes) -> None:
        pos = self._leaf_pos.pop(key, None)
        if pos is None:
            return
        last = self._leaves.pop()
        if last != key:
            self._leaves[pos] = last
            self._leaf_pos[last] = pos

    # --- hooks ---

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        if key in self._meta:  # re-registration: treat as a use
            self.on_hit(key)
            return
        now = self._clock()
        ghost = self._ghost.pop(key, None)
        if ghost is None:
            reuse, turn = 0, 0
        else:  # back after eviction: a reuse the eviction cut short; admitted as reused
            cls, last_use, evicted_at, reuse, turn = ghost
            if self._learn_late_hits:
                self.predictor.record_late_hit(cls, now - last_use, evicted_at)
            reuse += 1
        pmeta = self._meta.get(parent) if parent is not None else None
        if pmeta is not None:
            if pmeta[_CHILDREN] == 0:
                self._drop_leaf(parent)
            pmeta[_CHILDREN] += 1
            # a parent that was just matched (not just inserted) means a request extends an older chain
            pturn = pmeta[_TURN] + pmeta[_WAS_HIT]
            if pturn > turn:
                turn = pturn
        else:
            parent = None
        self._meta[key] = [now, reuse, 0, 0, parent, turn, 0]
        self._add_leaf(key)
        self._event()

    def on_hit(self, key: bytes) -> None:
        meta = self._meta.get(key)
        if meta is None:
            return
        now = self._clock()
        self.predictor.record_hit(_class_of(meta), now - meta[_T])
        meta[_REUSE] += 1
        meta[_T] = now
        meta[_WAS_HIT] = 1
        self._event()

    def on_release(self, key: bytes) -> None:
        meta = self._meta.get(key)
        if meta is None:
            return
        meta[_T] = self._clock()
        meta[_TAIL] = 1 if meta[_CHILDREN] == 0 else 0
        meta[_WAS_HIT] = 0

    def on_remove(self, key: bytes) -> None:
        meta = self._meta.pop(key)
        cls = _class_of(meta)
        age = self._clock() - meta[_T]
        self.predictor.record_eviction(cls, age)
        self._drop_leaf(key)
        parent = meta[_PARENT]
        if parent is not None:
            pmeta = self._meta.get(parent)
            if pmeta is not None:
                pmeta[_CHILDREN] -= 1
                if pmeta[_CHILDREN] == 0:
                    self._add_leaf(parent)
        ghost = self._ghost
        ghost[key] = (cls, meta[_T], age, meta[_REUSE], meta[_TURN])
        ghost.move_to_end(key)
        if len(ghost) > self._ghost_cap:
            ghost.popitem(last=False)

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        leaves = self._leaves
        n = len(leaves)
        if n:
            now = self._clock()
            meta_of = self._meta
            density = self.predictor.density
            bucket = self.predictor.bucket
            rnd = self._random.random
            scored = []
            for _ in range(self.samples if self.samples < n else n):
                key = leaves[int(rnd() * n)]
                meta = meta_of[key]
                age = now - meta[_T]
                scored.append((density[_class_of(meta)][bucket(age)], -age, key))
            scored.sort()
            for _score, _age, key in scored:
                if evictable(key):
                    return key
            for key in leaves:  # every sample was in use: take any evictable leaf
                if evictable(key):
                    return key
        for key in self._meta:  # the index disagrees with our leaf set (should not happen)
            if evictable(key):
                return key
        return None

    def reuse_count(self, key: bytes) -> int | None:
        """How often the cached block was reused (a block readmitted from the ghost list counts its
        earlier reuses plus one); None if it is not cached."""
        meta = self._meta.get(key)
        return None if meta is None else meta[_REUSE]

    def __len__(self) -> int:
        return len(self._meta)
