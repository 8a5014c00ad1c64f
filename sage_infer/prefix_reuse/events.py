"""`BlockEvents`: which KV blocks an engine holds, and in which tier, as an ordered log for KV-aware routers.

The prefix index appends an event when it registers a block on the device (stored) or
unregisters one (removed: evicted, or demoted). Each lower tier (host, disk, remote) does the
same when the migration policy places a block there or takes it out. A router reads the log in
one of two ways:

- ``since(n)`` (``GET /v1/kv/events``, polled by the prefill/decode router): the device's events
  as ``"+hash"`` / ``"-hash"`` strings;
- ``read(n)`` (``GET /v1/kv/events/stream``, pushed to the fleet router): every medium's events as
  ``(op, medium, hash)``.

Both start over with the whole current set (``reset``) when the reader fell further behind than
the bounded log holds, or is new. Applying an event twice changes nothing (stored adds to a set,
removed discards from it), so a snapshot taken while the engine thread appends is safe: an
event the snapshot already shows and the log repeats is harmless. Hashes are reported by their
first 8 bytes (16 hex digits): enough to route on; the engine still verifies what it loads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

HASH_PREFIX_BYTES = 8
MAX_EVENTS = 1 << 16
DEVICE = "device"
STORED, REMOVED = "stored", "removed"


def short(block_hash: bytes) -> str:
    return block_hash[:HASH_PREFIX_BYTES].hex()


@dataclass(frozen=True, slots=True)
class EventBatch:
    next: int  # pass as `since` next time
    reset: bool  # the reader was too far behind: `events` store the whole current set; forget the rest
    events: list[str]  # in order: "+<hash16>" stored, "-<hash16>" removed (device only)


@dataclass(frozen=True, slots=True)
class EventRead:
    """What `BlockEvents.read` hands a pushed stream: new events, or a snapshot when `reset`."""

    next: int
    reset: bool
    # (stored | removed, medium, hash16, parent hash16 or None, token ids), in order (empty when reset); the parent and
    # tokens of a block the device stored (what vLLM-format consumers hash by), else None and ()
    events: list[tuple[str, str, str, str | None, tuple[int, ...]]]
    snapshot: dict[str, list[str]]  # reset: medium -> every hash16 it holds now (empty otherwise)


class BlockEvents:
    """A bounded, thread-safe log of stored/removed blocks per medium (appended by the engine thread).

    `snapshot` lists the device's registered hashes; `add_medium` adds a lower tier's."""

    def __init__(self, snapshot: Callable[[], Iterable[bytes]], capacity: int = MAX_EVENTS) -> None:
        self._snapshots: dict[str, Callable[[], Iterable[bytes]]] = {DEVICE: snapshot}
        self._log: deque[tuple[str, str, str, str | None, tuple[int, ...]]] = deque(maxlen=capacity)
        self._next = 0  # sequence number of the next event
        self._lock = threading.Lock()

    def add_medium(self, medium: str, snapshot: Callable[[], Iterable[bytes]]) -> None:
        """A lower tier whose placements this log carries (`snapshot`: the hashes it holds now)."""
        self._snapshots[medium] = snapshot

    def stored(self, block_hash: bytes, medium: str = DEVICE, parent: bytes | None = None,
               token_ids: tuple[int, ...] = ()) -> None:
        entry = (STORED, medium, short(block_hash), None if parent is None else short(parent), token_ids)
        with self._lock:
            self._log.append(entry)
            self._next += 1

    def removed(self, block_hash: bytes, medium: str = DEVICE) -> None:
        entry = (REMOVED, medium, short(block_hash), None, ())
        with self._lock:
            self._log.append(entry)
            self._next += 1

    def since(self, n: int) -> EventBatch:
        """Device events numbered n and later; with ``reset`` when n is older than the log holds (or negative)."""
        with self._lock:
            oldest = self._next - len(self._log)
            if n < oldest or n > self._next or n < 0:
                return EventBatch(self._next, True, ["+" + h for h in self._hashes(DEVICE)])
            tail = list(self._log)[n - oldest:]
        return EventBatch(self._next, False, [("+" if op == STORED else "-") + h
                                              for op, medium, h, _, _ in tail if medium == DEVICE])

    def read(self, n: int) -> EventRead:
        """Every medium's events numbered n and later, or (n out of the log's range) the whole current set."""
        with self._lock:
            oldest = self._next - len(self._log)
            if n < oldest or n > self._next or n < 0:
                return EventRead(self._next, True, [], {m: self._hashes(m) for m in self._snapshots})
            return EventRead(self._next, False, list(self._log)[n - oldest:] if n < self._next else [], {})

    def _hashes(self, medium: str) -> list[str]:
        """The medium's current hashes. Its dict may change under us (the engine thread inserts before it logs):
        a copy that raced is taken again."""
        for _ in range(8):
            try:
                return [short(h) for h in list(self._snapshots[medium]())]
            except RuntimeError:  # dictionary changed size during iteration
                continue
        return [short(h) for h in list(self._snapshots[medium]())]
