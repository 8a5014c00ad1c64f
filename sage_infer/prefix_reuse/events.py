"""`BlockEvents`: what the prefix index stored and removed, in order, for a KV-aware router.

The index appends an event when it registers a block (stored) or unregisters one (removed:
evicted, or demoted to a lower tier). A router polls ``since(n)`` and keeps a per-instance set
of cached block hashes; it never sees the index itself. The log is bounded: a reader that
fell further behind than it holds gets ``reset=True`` and the full current set instead.
Hashes are reported by their first 8 bytes (16 hex digits): enough to route on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

HASH_PREFIX_BYTES = 8
MAX_EVENTS = 1 << 16


def short(block_hash: bytes) -> str:
    return block_hash[:HASH_PREFIX_BYTES].hex()


@dataclass(frozen=True, slots=True)
class EventBatch:
    next: int  # pass as `since` next time
    reset: bool  # the reader was too far behind: `events` store the whole current set; forget the rest
    events: list[str]  # in order: "+<hash16>" stored, "-<hash16>" removed


class BlockEvents:
    """A bounded, thread-safe log of stored/removed block hashes (appended by the engine thread)."""

    def __init__(self, snapshot: Callable[[], Iterable[bytes]], capacity: int = MAX_EVENTS) -> None:
        self._snapshot = snapshot  # every hash registered now (for a reader that must start over)
        self._log: deque[str] = deque(maxlen=capacity)
        self._next = 0  # sequence number of the next event
        self._lock = threading.Lock()

    def stored(self, block_hash: bytes) -> None:
        with self._lock:
            self._log.append("+" + short(block_hash))
            self._next += 1

    def removed(self, block_hash: bytes) -> None:
        with self._lock:
            self._log.append("-" + short(block_hash))
            self._next += 1

    def since(self, n: int) -> EventBatch:
        """Events numbered n and later; with ``reset`` when n is older than the log holds (or negative)."""
        with self._lock:
            oldest = self._next - len(self._log)
            if n < oldest or n > self._next or n < 0:
                now = self._next
                return EventBatch(now, True, ["+" + short(h) for h in list(self._snapshot())])
            return EventBatch(self._next, False, list(self._log)[n - oldest :])
