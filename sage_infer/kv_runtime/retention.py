"""`KVRetention`: cached blocks a client said it will come back for, kept ahead of other traffic's.

A stored Responses API response (`previous_response_id` continues it) names the blocks of its whole context. While
it is retained, the device's eviction takes every other cached block first; a retained block goes only when nothing
else can (and is then demoted to a lower tier like any evicted block), so retention changes the eviction order and
never the number of blocks a new request can get: it cannot starve the pool. Retention ends when its owner releases
it (the response is deleted or falls out of the store), when its TTL passes, or when a newer retention needs room
under `max_blocks` (the oldest goes first).

Keys are block hashes, never block ids: a retained block that was demoted and loaded back is the same block.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Held:
    hashes: tuple[bytes, ...]
    expires_at: float


class KVRetention:
    """Which cached blocks eviction spares while it can, by owner key (a stored response's id).

    `max_blocks`: the most distinct blocks retained at once (a share of the device pool); a retention that would pass
    it ends the oldest ones first, and one longer than it keeps its first `max_blocks` blocks (a prefix hit needs the
    chain from its start).
    """

    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self.clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()  # oldest first
        self._count: Counter[bytes] = Counter()  # block hash -> retentions naming it
        self._next_expiry = float("inf")
        self.evicted_under_pressure = 0  # retained blocks eviction took because nothing else was left
        self.dropped = 0  # retentions ended early to make room under max_blocks
        # told of the hashes that became retained (True) or stopped being (False): the device's block manager keeps
        # its retained cached blocks out of the eviction policy's queue (`BlockManager.retention`)
        self.on_change: Callable[[list[bytes], bool], None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks retained now."""
        return len(self._count)

    def holds(self, block_hash: bytes | None) -> bool:
        return block_hash is not None and block_hash in self._count

    def retain(self, key: str, hashes: Sequence[bytes], ttl_s: float) -> int:
        """Retain `hashes` (a chain, root first) for `key` until `ttl_s` passes; replaces what `key` held before.
        How many blocks are retained for it."""
        self.release(key)
        self.expire()
        chain = tuple(hashes[: self.max_blocks])
        if not chain:
            return 0
        new = {h for h in chain if h not in self._count}
        while self._held and len(self._count) + len(new) > self.max_blocks:
            self._end(next(iter(self._held)))
            self.dropped += 1
            new = {h for h in chain if h not in self._count}
        expires_at = self.clock() + ttl_s
        self._held[key] = _Held(chain, expires_at)
        gained = [h for h in dict.fromkeys(chain) if h not in self._count]
        self._count.update(chain)
        self._next_expiry = min(self._next_expiry, expires_at)
        if gained and self.on_change is not None:
            self.on_change(gained, True)
        return len(chain)

    def release(self, key: str) -> bool:
        """End `key`'s retention; False when it held nothing."""
        if key not in self._held:
            return False
        self._end(key)
        return True

    def expire(self) -> int:
        """End every retention whose TTL has passed; how many. Cheap when none has."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        ended = [key for key, held in self._held.items() if held.expires_at <= now]
        for key in ended:
            self._end(key)
        self._next_expiry = min((held.expires_at for held in self._held.values()), default=float("inf"))
        return len(ended)

    def _end(self, key: str) -> None:
        held = self._held.pop(key)
        self._count.subtract(held.hashes)
        lost = []
        for block_hash in held.hashes:
            if self._count.get(block_hash, 0) <= 0 and block_hash in self._count:
                del self._count[block_hash]
                lost.append(block_hash)
        if lost and self.on_change is not None:
            self.on_change(lost, False)

    def chains(self) -> Iterator[tuple[bytes, ...]]:
        """Each retention's blocks (root first), the oldest retention first."""
        return (held.hashes for held in self._held.values())

    def stats(self) -> dict[str, int]:
        return {"retained_sessions": len(self._held), "retained_blocks": self.num_blocks,
                "retained_evicted_under_pressure": self.evicted_under_pressure}
