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
the bounded log holds, or is new.

An engine with KV groups (sliding-window layers: `kv_runtime.group_kv_manager`) registers a group's
block under a key of its own; it names each such block first (`name`: its chained prefix hash, its
parent's, its group), so every event and snapshot names a block by its chained hash and its group
(`kv_policy.group_hit.group_key`: ``hash16`` in group 0, ``hash16@g`` in group g), as a router
hashes a prompt. Applying an event twice changes nothing (stored adds to a set,
removed discards from it), so a snapshot taken while the engine thread appends is safe: an
event the snapshot already shows and the log repeats is harmless. Hashes are reported by their
first 8 bytes (16 hex digits): enough to route on; the engine still verifies what it loads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sage_infer.kv_policy.group_hit import group_key

HASH_PREFIX_BYTES = 8
MAX_EVENTS = 1 << 16
MAX_NAMES = 1 << 18  # names of KV groups' blocks kept while a lower tier may still hold them (oldest dropped first)
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
    # (stored | removed, medium, key, parent hash16 or None, token ids, KV group or None), in order (empty when reset):
    # key is the block's hash16 with its group (`group_key`); the parent and tokens of a block the device stored (what
    # vLLM-format consumers hash by), else None and (); the group None for an engine without KV groups
    events: list[tuple[str, str, str, str | None, tuple[int, ...], int | None]]
    snapshot: dict[str, list[str]]  # reset: medium -> every key it holds now (empty otherwise)


class BlockEvents:
    """A bounded, thread-safe log of stored/removed blocks per medium (appended by the engine thread).

    `snapshot` lists the device's registered hashes; `add_medium` adds a lower tier's."""

    def __init__(self, snapshot: Callable[[], Iterable[bytes]], capacity: int = MAX_EVENTS) -> None:
        self._snapshots: dict[str, Callable[[], Iterable[bytes]]] = {DEVICE: snapshot}
        self._log: deque[tuple[str, str, str, str | None, tuple[int, ...], int | None]] = deque(maxlen=capacity)
        self._next = 0  # sequence number of the next event
        self._lock = threading.Lock()
        self.grouped = False  # the engine keeps KV groups: every event names its group
        # the index hash of a KV group's block registered under a key of its own -> (its hash16, its parent's, group)
        self._names: dict[bytes, tuple[str, str | None, int]] = {}

    def add_medium(self, medium: str, snapshot: Callable[[], Iterable[bytes]]) -> None:
        """A lower tier whose placements this log carries (`snapshot`: the hashes it holds now)."""
        self._snapshots[medium] = snapshot

    def name(self, block_hash: bytes, chain_hash: bytes, parent: bytes | None, group: int) -> None:
        """The device block the index registers as `block_hash` (under a key of its own) is KV group `group`'s block
        of chained prefix hash `chain_hash`, whose parent is `parent`: its events name it so. Called before the index
        registers it (a block already registered is named the same again, and is the newest name kept)."""
        self._names.pop(block_hash, None)
        self._names[block_hash] = (short(chain_hash), None if parent is None else short(parent), group)

    def stored(self, block_hash: bytes, medium: str = DEVICE, parent: bytes | None = None,
               token_ids: tuple[int, ...] = ()) -> None:
        named = self._names.get(block_hash) if self._names else None
        if named is not None:
            entry = (STORED, medium, group_key(named[0], named[2]), named[1] if medium == DEVICE else None, token_ids,
                     named[2])
        else:
            entry = (STORED, medium, short(block_hash), None if parent is None else short(parent), token_ids,
                     0 if self.grouped else None)
        with self._lock:
            self._log.append(entry)
            self._next += 1

    def removed(self, block_hash: bytes, medium: str = DEVICE) -> None:
        named = self._forget(block_hash, medium) if self._names else None
        if named is not None:
            entry = (REMOVED, medium, group_key(named[0], named[2]), None, (), named[2])
        else:
            entry = (REMOVED, medium, short(block_hash), None, (), 0 if self.grouped else None)
        with self._lock:
            self._log.append(entry)
            self._next += 1

    def _forget(self, block_hash: bytes, medium: str) -> tuple[str, str | None, int] | None:
        """The block's name; dropped when the device lets it go and no lower tier can take it (else kept, at most
        `MAX_NAMES`: a tier's later events about it name it too)."""
        if medium != DEVICE or len(self._snapshots) > 1:
            while len(self._names) > MAX_NAMES:
                del self._names[next(iter(self._names))]
            return self._names.get(block_hash)
        return self._names.pop(block_hash, None)

    def since(self, n: int) -> EventBatch:
        """Device events numbered n and later; with ``reset`` when n is older than the log holds (or negative)."""
        with self._lock:
            oldest = self._next - len(self._log)
            if n < oldest or n > self._next or n < 0:
                return EventBatch(self._next, True, ["+" + h for h in self._hashes(DEVICE)])
            tail = list(self._log)[n - oldest:]
        return EventBatch(self._next, False, [("+" if op == STORED else "-") + h
                                              for op, medium, h, *_ in tail if medium == DEVICE])

    def read(self, n: int) -> EventRead:
        """Every medium's events numbered n and later, or (n out of the log's range) the whole current set."""
        with self._lock:
            oldest = self._next - len(self._log)
            if n < oldest or n > self._next or n < 0:
                return EventRead(self._next, True, [], {m: self._hashes(m) for m in self._snapshots})
            return EventRead(self._next, False, list(self._log)[n - oldest:] if n < self._next else [], {})

    def _hashes(self, medium: str) -> list[str]:
        """The medium's current keys. Its dict may change under us (the engine thread inserts before it logs):
        a copy that raced is taken again."""
        for _ in range(8):
            try:
                return self._keys(list(self._snapshots[medium]()), medium)
            except RuntimeError:  # dictionary changed size during iteration
                continue
        return self._keys(list(self._snapshots[medium]()), medium)

    def _keys(self, hashes: list[bytes], medium: str) -> list[str]:
        if not self._names:
            return [short(h) for h in hashes]
        names = self._names
        return [short(h) if (named := names.get(h)) is None else group_key(named[0], named[2]) for h in hashes]
