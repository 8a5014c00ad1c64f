"""`RecencyOrder`: blocks in the order they were last used, and the k-th oldest evictable one in O(log n).

The fleet router forecasts which of a replica's device blocks LRU evicts before a newcomer starts:
the k oldest of the blocks no request in flight holds, k being what the replica's queue will
allocate past its capacity (`kv_policy.fleet_index`). Near saturation k runs to thousands of blocks
per replica, so walking the k oldest for every request would cost milliseconds; here each use takes
a new stamp, a Fenwick tree over the stamps counts the evictable blocks, and the stamp of the k-th
oldest evictable block is one descent of the tree. Stamps are renumbered (and blocks that are
neither stored nor held forgotten) when they run out.
"""

from __future__ import annotations

from collections.abc import Callable

MIN_SIZE = 1024


class RecencyOrder:
    def __init__(self) -> None:
        self.stamps: dict[str, int] = {}  # block -> stamp of its last use (higher: more recent)
        self.evictable: set[str] = set()  # blocks counted in the tree
        self.size = MIN_SIZE
        self.tree = [0] * (self.size + 1)  # Fenwick tree over stamps 1..size: 1 where an evictable block sits
        self.known = [0] * (self.size + 1)  # the same over every known block
        self.next = 1
        self.count = 0  # evictable blocks

    def __len__(self) -> int:
        return len(self.stamps)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self.stamps

    def touch(self, block_hash: str, keep: Callable[[str], bool]) -> None:
        """`block_hash` is now the most recently used (`keep`: which blocks a renumbering may not forget)."""
        if self.next > self.size:
            self._renumber(keep)
        old = self.stamps.get(block_hash)
        if old is not None:
            _add(self.known, old, -1)
            if block_hash in self.evictable:
                _add(self.tree, old, -1)
        self.stamps[block_hash] = stamp = self.next
        self.next += 1
        _add(self.known, stamp, 1)
        if block_hash in self.evictable:
            _add(self.tree, stamp, 1)

    def add(self, block_hash: str, keep: Callable[[str], bool]) -> None:
        """Known from now on, as the most recently used, unless already known (it keeps its place)."""
        if block_hash not in self.stamps:
            self.touch(block_hash, keep)

    def discard(self, block_hash: str) -> None:
        stamp = self.stamps.pop(block_hash, None)
        if stamp is None:
            return
        _add(self.known, stamp, -1)
        if block_hash in self.evictable:
            self.evictable.discard(block_hash)
            _add(self.tree, stamp, -1)
            self.count -= 1

    def set_evictable(self, block_hash: str, evictable: bool) -> None:
        """Whether LRU may take the (known) block: stored and held by no request in flight."""
        stamp = self.stamps.get(block_hash)
        if stamp is None or evictable == (block_hash in self.evictable):
            return
        if evictable:
            self.evictable.add(block_hash)
            _add(self.tree, stamp, 1)
            self.count += 1
        else:
            self.evictable.discard(block_hash)
            _add(self.tree, stamp, -1)
            self.count -= 1

    def oldest_evictable_stamp(self, k: int) -> int:
        """The stamp of the k-th oldest evictable block (k >= 1); past the last one, every stamp."""
        if k >= self.count:
            return self.next
        position, step = 0, 1 << self.size.bit_length()
        while step:
            if position + step <= self.size and self.tree[position + step] < k:
                position += step
                k -= self.tree[position]
            step >>= 1
        return position + 1

    def among_oldest(self, block_hash: str, threshold: int) -> bool:
        """Whether an evictable `block_hash` is at or before `threshold` (`oldest_evictable_stamp`)."""
        return block_hash in self.evictable and self.stamps[block_hash] <= threshold

    def newer_than(self, block_hash: str) -> int:
        """How many known blocks were used after the (known) `block_hash`: its LRU stack distance."""
        i, below = self.stamps[block_hash], 0
        while i > 0:
            below += self.known[i]
            i -= i & -i
        return len(self.stamps) - below

    def _renumber(self, keep: Callable[[str], bool]) -> None:
        """Stamps 1..n in the same order, forgetting blocks `keep` lets go; room for as many again."""
        order = sorted((s, h) for h, s in self.stamps.items() if h in self.evictable or keep(h))
        self.size = max(MIN_SIZE, 2 * len(order))
        self.stamps = {h: i for i, (_, h) in enumerate(order, 1)}
        self.evictable &= self.stamps.keys()
        self.count = len(self.evictable)
        self.tree = _built(self.size, [i for i, (_, h) in enumerate(order, 1) if h in self.evictable])
        self.known = _built(self.size, range(1, len(order) + 1))
        self.next = len(order) + 1


def _add(tree: list[int], i: int, delta: int) -> None:
    size = len(tree) - 1
    while i <= size:
        tree[i] += delta
        i += i & -i


def _built(size: int, ones) -> list[int]:
    """A Fenwick tree over 1..size with a 1 at each of `ones`, in O(size)."""
    tree = [0] * (size + 1)
    for i in ones:
        tree[i] += 1
    for i in range(1, size + 1):
        parent = i + (i & -i)
        if parent <= size:
            tree[parent] += tree[i]
    return tree
