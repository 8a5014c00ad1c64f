"""`KVTier`: the one contract every KV tier store speaks, and what the stores share.

A block is an opaque row of `schema.bytes_per_block` bytes, keyed by its 32-byte chained
block hash (`prefix_reuse.hashing.hash_block`, which already covers model, revision, KV
dtype, layout and tenant salt). Calls are batch-first: `blocks` is a
``[n, bytes_per_block]`` uint8 tensor, one row per key.

Contract, the same for host, disk and remote:

- `put` never fails because the tier is full: the tier evicts its own oldest blocks.
- Every block carries a CRC32C taken when it was stored and checked when it is read; a
  mismatch is a miss, is counted in `checksum_failures`, and the bad block is deleted.
- `get_prefix` returns the longest *verified* prefix of a chain: a miss or a bad checksum
  at block i means blocks i.. are not returned, which is exactly what a caller loading a
  chain can use (it recomputes from block i on).
- A tier that cannot be reached raises `TierError` (it never hangs past its timeout).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError

KEY_BYTES = 32  # sha256 chained block hash
SCHEMA_DIGEST_BYTES = 16
# a block stored as one value in a remote store: magic, payload CRC32C, payload length, then the payload
VALUE_HEADER = struct.Struct("<4sII")


def pack_value_header(into, magic: bytes, payload) -> None:
    """Write the value header of `payload` at the start of `into` (a writable buffer)."""
    VALUE_HEADER.pack_into(into, 0, magic, crc32c.crc32c(payload), len(memoryview(payload).cast("B")))


def value_header(magic: bytes, payload) -> bytes:
    """The value header of `payload`, as bytes to prepend."""
    out = bytearray(VALUE_HEADER.size)
    pack_value_header(out, magic, payload)
    return bytes(out)


def verify_value(value, magic: bytes, payload_bytes: int) -> bool:
    """A whole stored value: the right size, magic and length, and a payload whose CRC32C matches."""
    view = memoryview(value).cast("B")
    if len(view) != VALUE_HEADER.size + payload_bytes:
        return False
    found, crc, length = VALUE_HEADER.unpack_from(view)
    return found == magic and length == payload_bytes and crc32c.crc32c(view[VALUE_HEADER.size :]) == crc


def schema_digest(schema: KVCacheSchema) -> bytes:
    """16-byte digest of the schema's canonical JSON: blocks are only read back under the same one."""
    text = json.dumps(schema.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).digest()[:SCHEMA_DIGEST_BYTES]


@dataclass(slots=True)
class TierStats:
    """Counters of one tier. Block counts, not calls: a `get` of 8 keys adds 8 to `gets`.

    `misses` = blocks asked for and not returned (a hole in a chain hides the blocks after it).
    `dropped` = blocks offered to `put` and not stored (bigger than the whole tier, or the
    disk writer's queue was full). `fragmentation` = dead bytes / segment bytes (disk only).
    """

    name: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    errors: int = 0
    dropped: int = 0
    fragmentation: float = 0.0
    pending_blocks: int = 0  # disk: queued for the writer thread, already readable
    skipped_records: int = 0  # disk: records ignored at start-up (torn header, other schema)


class KVTier(ABC):
    """A bounded store of whole KV blocks below the device pool (the contract is the module's docstring), and what
    the stores share: argument checks, the get/get_prefix pair over one `_load`, counters.

    A store implements `put`, `contains`, `delete`, `close`, and `_load(keys, out, prefix)`: fill ``out[i]``
    for each stored and verified key and return which were filled; with `prefix=True` it may stop at the first
    miss. Counters are updated under `self._lock` (stores use the same lock).
    """

    name: str
    # True for a store other servers read and write too (remote): a server never deletes from it what
    # it loads or recomputes (another server may want the block); the store's own capacity bound evicts
    shared: bool = False
    # its blocks outlive this process on this machine (a restart on the same store finds them)
    persistent: bool = False

    def __init__(self, schema: KVCacheSchema, capacity_bytes: int, name: str) -> None:
        if capacity_bytes < schema.bytes_per_block:
            raise TierConfigError(
                f"{name} tier capacity {capacity_bytes} B is smaller than one KV block ({schema.bytes_per_block} B)"
            )
        self.schema = schema
        self.name = name
        self.bytes_per_block = schema.bytes_per_block
        self.capacity_bytes = int(capacity_bytes)
        self.digest = schema_digest(schema)
        self._stats = TierStats(name=name, capacity_bytes=self.capacity_bytes)
        self._lock = threading.RLock()
        # failures off the caller's thread, until taken: a deque, so taking them never waits for the tier's lock
        # (held through a store's or load's copy)
        self._background_errors: deque[str] = deque()

    # -- the contract -------------------------------------------------------------------------

    @abstractmethod
    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store `blocks[i]` (``[n, bytes_per_block]`` uint8) under `keys[i]`; evicts, never fails when full."""

    def put_gather(self, keys: Sequence[bytes], gather: Callable[[list[int], torch.Tensor], None]) -> None:
        """`put` of blocks the caller copies in itself: `gather(rows, out)` writes rows `rows` of the batch into
        `out` (``[len(rows), bytes_per_block]`` uint8, contiguous, CPU). A store with a buffer of its own (the host
        tier's slab, the disk tier's queue) hands out its buffer, so a batch gathered from the device pool is
        copied once; this default gathers into a fresh buffer and puts that."""
        keys = self._check_keys(keys)
        out = torch.empty((len(keys), self.bytes_per_block), dtype=torch.uint8)
        if keys:
            gather(list(range(len(keys))), out)
        self.put(keys, out)

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (no checksum check: that happens on read)."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget the keys (absent keys are ignored)."""

    @abstractmethod
    def close(self) -> None: ...

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Rows of one freshly allocated ``[n, bytes_per_block]`` tensor (None for misses)."""
        keys = self._check_keys(keys)
        out = torch.empty((len(keys), self.bytes_per_block), dtype=torch.uint8)
        found = self._load(keys, out, prefix=False) if keys else []
        self._count_gets(len(keys), sum(found))
        return [out[i] if hit else None for i, hit in enumerate(found)]

    def get_prefix(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """``out[:k]`` where k is the number of leading keys stored and verified.

        `out`: ``[>= n, bytes_per_block]`` uint8 CPU tensor to load into (a pinned staging
        buffer, say); allocated when None. Rows past k are unspecified.
        """
        keys = self._check_keys(keys)
        if out is None:
            out = torch.empty((len(keys), self.bytes_per_block), dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] < len(keys) or (
            out.shape[1] != self.bytes_per_block
        ):
            raise ValueError(f"out must be uint8 [>={len(keys)}, {self.bytes_per_block}], got {tuple(out.shape)}")
        found = self._load(keys, out, prefix=True) if keys else []
        k = found.index(False) if False in found else len(found)
        self._count_gets(len(keys), k)
        return out[:k]

    @property
    def checksum_failures(self) -> int:
        """Blocks read back corrupt so far (cheap: no refresh, unlike `stats`)."""
        return self._stats.checksum_failures

    def flush(self, sync: bool = False) -> None:  # noqa: B027 - a tier that stores as it is called has nothing to do
        """Wait until every block put so far is stored (`sync`: durably); a tier that stores synchronously has
        nothing to wait for."""

    def take_background_errors(self) -> list[str]:
        """What failed since the last call in work the tier does on its own (the disk tier's writer thread), each
        as one line; the caller (`HierarchyManager`) counts them and rests the tier."""
        errors = []
        try:
            while True:  # appends and pops of a deque are atomic: no lock taken
                errors.append(self._background_errors.popleft())
        except IndexError:
            return errors

    def stats(self) -> TierStats:
        with self._lock:
            self._refresh_stats()
            return TierStats(**{f: getattr(self._stats, f) for f in TierStats.__slots__})

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for subclasses -----------------------------------------------------------------------

    @abstractmethod
    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]: ...

    @abstractmethod
    def _refresh_stats(self) -> None:
        """Fill gauges (blocks, bytes, fragmentation) into `self._stats`; called under the lock."""

    def _count_gets(self, asked: int, returned: int) -> None:
        with self._lock:
            self._stats.gets += asked
            self._stats.hits += returned
            self._stats.misses += asked - returned

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        keys = list(keys)
        if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:  # (the usual case, in C)
            return keys
        for key in keys:
            if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
                raise ValueError(f"a block key is a {KEY_BYTES}-byte hash, got {type(key).__name__} {key!r:.40}")
        return [bytes(k) for k in keys]

    @staticmethod
    def _batch_head(keys: list[bytes], limit: int) -> tuple[list[bytes], dict[bytes, int]]:
        """A put's distinct keys in order, at most `limit` (a chain's head, when the batch is bigger than the
        tier), and the row of each key's first occurrence."""
        rows = {key: row for row, key in reversed(list(enumerate(keys)))}
        return list(dict.fromkeys(keys))[:limit], rows

    def _check_put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> tuple[list[bytes], torch.Tensor]:
        """Keys and blocks as ``[n, bytes_per_block]`` uint8 rows (other dtypes are viewed as bytes)."""
        keys = self._check_keys(keys)
        if blocks.dtype != torch.uint8:
            blocks = blocks.contiguous().view(torch.uint8)
        if blocks.numel() == len(keys) * self.bytes_per_block:
            blocks = blocks.reshape(len(keys), self.bytes_per_block)
        if blocks.shape != (len(keys), self.bytes_per_block):
            raise ValueError(
                f"blocks must be [{len(keys)}, {self.bytes_per_block}] bytes for {len(keys)} keys, "
                f"got {tuple(blocks.shape)}"
            )
        return keys, blocks
