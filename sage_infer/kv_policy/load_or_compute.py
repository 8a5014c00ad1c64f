"""Load a prompt's blocks from a lower tier, or compute them again: decided per request from measured speeds.

A tier hit is worth having only when reading the blocks back is faster than the prefill it replaces; a slow tier
(a remote store over a busy link, a disk behind a queue) can cost more than recomputing, and then loading makes the
first token later, not sooner. `LoadOrCompute` keeps two measured rates, both moving averages of what this engine
actually did: the prefill rate (tokens per second of steps that computed at least `MIN_PREFILL_TOKENS` prompt
tokens) and each tier's read rate (bytes per second of its reads). For a prompt whose next blocks sit below the
device, it loads the longest leading run whose loading saves time overall and computes the rest: each block saves
``block_tokens / prefill rate - block bytes / its tier's read rate``. Until a rate is measured the blocks are loaded
(what the engine did before it knew better).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_PREFILL_TOKENS = 256  # a step that computed fewer prompt tokens says more about its overheads than the rate
MIN_READ_BYTES = 1 << 16  # likewise for a tier read
WEIGHT = 0.2  # of the newest observation in a rate's moving average


@dataclass(slots=True)
class Rate:
    """A moving average of units per second; None until observed."""

    per_s: float | None = None
    observations: int = 0

    def observe(self, units: float, seconds: float) -> None:
        rate = units / seconds
        self.per_s = rate if self.per_s is None else self.per_s + WEIGHT * (rate - self.per_s)
        self.observations += 1


@dataclass
class LoadOrCompute:
    """The measured prefill and tier read rates of one engine, and the decision they make (`blocks_to_load`).
    Observed on the engine thread (prefill, reads at admission) and a loader thread (prefetch reads)."""

    block_tokens: int
    block_nbytes: int
    prefill: Rate = field(default_factory=Rate)
    reads: dict[int, Rate] = field(default_factory=dict)  # tier level (1 = fastest lower tier) -> bytes per second
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self.prefill.observe(tokens, seconds)

    def observe_read(self, level: int, nbytes: int, seconds: float) -> None:
        if nbytes >= MIN_READ_BYTES and seconds > 0:
            with self._lock:
                self.reads.setdefault(level, Rate()).observe(nbytes, seconds)

    def saving_s(self, level: int) -> float | None:
        """Seconds loading one block from tier `level` saves against computing it (None: not measured yet)."""
        read = self.reads.get(level)
        if self.prefill.per_s is None or read is None or read.per_s is None:
            return None
        return self.block_tokens / self.prefill.per_s - self.block_nbytes / read.per_s

    def blocks_to_load(self, levels: Sequence[int]) -> int:
        """Of a prompt's next blocks below the device (`levels[i]`: the tier holding block i), how many leading
        ones to load: the run whose loading saves the most time in all (every one while a rate is unmeasured)."""
        best = best_at = total = 0.0
        for i, level in enumerate(levels, 1):
            saving = self.saving_s(level)
            total += saving if saving is not None else float("inf")
            if total >= best:
                best, best_at = total, i
        return int(best_at)
