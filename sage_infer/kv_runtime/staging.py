"""`StagingBuffers`: the host buffers lower-tier reads land in, kept and reused between loads.

A load reads a chain's blocks out of the tiers into one ``[n, block_nbytes]`` buffer, and admission
copies them into the pool. A fresh buffer for every load pays for its pages on first touch: on a
2-vCPU KVM guest a 96 MiB host-tier read into a new buffer took ~58 ms, into one touched before
~12 ms (`bench/load_vs_recompute.py` reports the read's share of a loaded TTFT). On an accelerator a
fresh page-locked buffer costs a `cudaHostAlloc` per load as well.

A buffer is handed out by `acquire` and comes back only through `release` (after its rows were
written into the pool), so one a load still writes into (an abandoned, timed-out read) is never
handed out again. The books hold the buffers handed out by weak reference (the last `LENT_TRACKED`),
so one never released is freed with its last reference, as before. At most `RETAIN_BUFFERS` buffers
of `RETAIN_MAX_BYTES` in all are kept; a larger load allocates its own.
"""

from __future__ import annotations

import threading
import weakref

import torch

RETAIN_BUFFERS = 2  # loads prefetched at once reuse up to this many buffers
RETAIN_MAX_BYTES = 1 << 30  # kept in all; a load above this allocates (and frees) its own buffer
LENT_TRACKED = 8  # buffers handed out and not released that the books keep (an abandoned load's is forgotten)
ROUND_ROWS = 64  # buffers are sized in multiples of this many rows, so nearby lengths reuse one


class StagingBuffers:
    """Reusable ``[rows, row_bytes]`` uint8 host buffers (page-locked when `pin`)."""

    def __init__(self, row_bytes: int, pin: bool = False, retain_bytes: int = RETAIN_MAX_BYTES,
                 retain_buffers: int = RETAIN_BUFFERS) -> None:
        self.row_bytes = row_bytes
        self.pin = pin
        self.retain_bytes = retain_bytes
        self.retain_buffers = retain_buffers
        self._free: list[torch.Tensor] = []  # released buffers, smallest first
        # storage address -> a buffer handed out, oldest first (weakly: an abandoned one is not kept alive here)
        self._lent: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self.reused = 0  # loads served from a kept buffer (tests and benches read it)
        self.allocated = 0

    def acquire(self, rows: int) -> torch.Tensor:
        """A buffer of at least `rows` rows (its first `rows` are what the caller fills)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.shape[0] >= rows:
                    del self._free[i]
                    self._lend(buffer)
                    self.reused += 1
                    return buffer
        size = -(-max(rows, 1) // ROUND_ROWS) * ROUND_ROWS
        buffer = torch.empty((size, self.row_bytes), dtype=torch.uint8, pin_memory=self.pin)
        self.allocated += 1
        if size * self.row_bytes <= self.retain_bytes:  # (a larger one is never kept: not worth tracking)
            with self._lock:
                self._lend(buffer)
        return buffer

    def _lend(self, buffer: torch.Tensor) -> None:
        self._lent[buffer.untyped_storage().data_ptr()] = weakref.ref(buffer)
        while len(self._lent) > LENT_TRACKED:
            del self._lent[next(iter(self._lent))]

    def release(self, rows: torch.Tensor | None) -> None:
        """`rows` (a view of an acquired buffer, or any other tensor: ignored) are no longer needed."""
        if rows is None or rows.device.type != "cpu":
            return
        with self._lock:
            lent = self._lent.pop(rows.untyped_storage().data_ptr(), None)
            buffer = lent() if lent is not None else None
            if buffer is None or buffer.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr():
                return
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.shape[0])
            # keep the largest that fit the budget: a long prompt's load needs the big one
            while self._free and (len(self._free) > self.retain_buffers or self.kept_bytes > self.retain_bytes):
                del self._free[0]

    @property
    def kept_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._free)
