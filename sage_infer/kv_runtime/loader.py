"""`KVLoader`: lower-tier reads off the engine thread.

When a request enters the waiting queue, the KV cache manager looks its prompt up in the
lower tiers and, on a hit, starts reading those blocks here (a prefetch). The scheduler
skips a request whose load is still running, so the others keep computing; when the read is
done, admission claims the rows (the tiers' books change only on the engine thread). A load
that misses its deadline is abandoned: the request recomputes those blocks, and whatever
the read returns later is dropped.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sage_infer.kv_runtime.hierarchy import HierarchyManager
from sage_infer.kv_runtime.prefetch_stats import PrefetchStats


@dataclass(slots=True)
class PendingLoad:
    keys: list[bytes]  # the chain's blocks being read, right after `device_blocks` device blocks
    device_blocks: int
    future: concurrent.futures.Future
    deadline: float


class KVLoader:
    """One background reader for a `HierarchyManager`; loads are keyed by sequence id."""

    def __init__(self, hierarchy: HierarchyManager, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hierarchy = hierarchy
        self.timeout_s = timeout_s
        self.clock = clock
        self.pending: dict[int, PendingLoad] = {}
        self.stats = PrefetchStats()
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sage-kv-load")

    def start(self, seq_id: int, keys: Sequence[bytes], device_blocks: int) -> None:
        keys = list(keys)
        future = self._threads.submit(self.hierarchy.read, keys)
        self.pending[seq_id] = PendingLoad(keys, device_blocks, future, self.clock() + self.timeout_s)
        self.stats.issue(len(keys))

    def is_loading(self, seq_id: int) -> bool:
        """A read is running and its deadline has not passed (the request should wait)."""
        load = self.pending.get(seq_id)
        return load is not None and not load.future.done() and self.clock() < load.deadline

    def take(self, seq_id: int, keys: Sequence[bytes], device_blocks: int) -> torch.Tensor | None:
        """The rows a finished load got for `keys` (at most ``len(keys)``, a verified prefix), claimed from the tiers.

        `keys` is what a lookup finds now; the load read what it found when it started. They
        agree on their common prefix unless the device prefix moved; then there is no usable
        load and None says so (the caller reads synchronously). A load past its deadline gives
        no rows: the caller recomputes rather than wait.
        """
        load = self.pending.pop(seq_id, None)
        if load is None:
            return None
        common = min(len(keys), len(load.keys))
        if load.device_blocks != device_blocks or list(keys[:common]) != load.keys[:common]:
            self._abandon(load, "dropped")
            return None
        if not load.future.done():
            self._abandon(load, "timeout")  # a read already running finishes and is ignored
            self.hierarchy.stats.failures["timeout"] += len(load.keys)
            return torch.empty((0, self.hierarchy.pool.block_nbytes), dtype=torch.uint8)
        rows = self.hierarchy.claim(load.keys, load.future.result())[: len(keys)]
        self.stats.use(rows.shape[0], len(load.keys))
        return rows

    def _abandon(self, load: PendingLoad, reason: str) -> None:
        """Counted as wasted: its blocks moved for nothing, unless it was cancelled before it started reading."""
        self.stats.waste(reason, 0 if load.future.cancel() else len(load.keys))

    def drop(self, seq_id: int) -> None:
        """The request no longer needs its load (finished, aborted)."""
        load = self.pending.pop(seq_id, None)
        if load is not None:
            self._abandon(load, "dropped")

    def wait(self, timeout: float) -> None:
        """Block until some load finishes or `timeout` seconds pass (an engine with nothing else to do)."""
        futures = [load.future for load in self.pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
