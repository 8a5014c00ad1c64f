"""`EvictionPolicy`: the object that decides which cached KV block goes first.

One policy instance orders the blocks of one prefix index. The same classes run inside
the engine and inside the trace replay simulator, so what `sage kv replay` measures is
exactly what serving does. Keys are block hashes (bytes), never block ids: a hash names
the content, so a replayed trace and a live pool speak of the same block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, TypeVar


class EvictionPolicy(ABC):
    """Orders cached blocks for eviction. Keys are block hashes (bytes).

    Hooks, in the order a block sees them: `on_insert` when its KV is registered,
    `on_hit` when a request reuses it, `on_use` when a request holds it (the device's
    index only), `on_release` when the last request using it lets go (it becomes
    evictable), `on_remove` when it leaves the cache.
    """

    __slots__ = ()
    name: ClassVar[str]

    @abstractmethod
    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        """A block entered the cache. `depth` is its position in its prefix chain (0 = first
        block of a prompt), `parent` the key of the block before it (None at depth 0)."""

    def tick(self, now: float) -> None:  # noqa: B027 - optional hook
        """The clock, in seconds: the engine passes monotonic time before each admission,
        the replay passes the trace's timestamps. Default: no effect."""

    @abstractmethod
    def on_hit(self, key: bytes) -> None:
        """A request matched this cached block."""

    def on_use(self, key: bytes) -> None:  # noqa: B027 - optional hook, most policies ignore it
        """A request took this cached block: it cannot be a victim until `on_release`. Default: no effect."""

    def on_release(self, key: bytes) -> None:  # noqa: B027 - optional hook, most policies ignore it
        """The last request holding this block released it. Default: no effect."""

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """The block left the cache (evicted or dropped); forget it."""

    @abstractmethod
    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """Best key to evict among keys for which `evictable(key)` is True; None if none.

        Does not remove the key: the caller evicts it and then calls `on_remove`.
        """


class HeldKeys:
    """Keys requests hold, taken out of a two-queue policy's queues (`first`, `second`: ARC's T1 / T2, S3-FIFO's S / M)
    until released, each remembering its queue; both queues' sizes still count them (`in_first`, `in_second`)."""

    __slots__ = ("_queue", "in_first")

    def __init__(self) -> None:
        self._queue: dict[bytes, bool] = {}  # key -> whether it was taken from `first`
        self.in_first = 0

    def __contains__(self, key: object) -> bool:
        return key in self._queue

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def in_second(self) -> int:
        return len(self._queue) - self.in_first

    def take(self, key: bytes, first: dict, second: dict) -> None:
        """Out of whichever queue holds `key` (none: nothing happens)."""
        if key in first:
            del first[key]
            self._queue[key] = True
            self.in_first += 1
        elif key in second:
            del second[key]
            self._queue[key] = False

    def pop(self, key: bytes) -> bool | None:
        """Forget a held key: whether it was taken from `first`; None when it is not held."""
        in_first = self._queue.pop(key, None)
        if in_first:
            self.in_first -= 1
        return in_first

    def to_second(self, key: bytes) -> None:
        """A held key now belongs to `second` (ARC: a hit moves a T1 block to T2)."""
        if self._queue[key]:
            self._queue[key] = False
            self.in_first -= 1

    def keys(self, first: bool) -> list[bytes]:
        return [key for key, in_first in self._queue.items() if in_first == first]


P = TypeVar("P", bound=type[EvictionPolicy])

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make a policy constructible by `make_policy(name)`."""

    def register(cls: P) -> P:
        if name in POLICIES:
            raise ValueError(f"eviction policy {name!r} is already registered by {POLICIES[name].__name__}")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return register


def make_policy(name: str, capacity: int | None = None) -> EvictionPolicy:
    """A fresh policy instance by registered name; unknown names raise ValueError naming the known ones.

    `capacity` (blocks) is passed to policies that size internal queues from it (ARC,
    S3-FIFO, sage); others ignore it.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES)) or "none"
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}") from None
    return cls(capacity=capacity) if getattr(cls, "uses_capacity", False) else cls()
