"""Load a prompt's blocks from a lower tier, or compute them again: decided per request from measured speeds.

A tier hit is worth having only when reading the blocks back is faster than the prefill it replaces; a slow tier
(a remote store over a busy link, a disk behind a queue) can cost more than recomputing, and then loading makes the
first token later, not sooner. `LoadOrCompute` keeps two measured rates, both moving averages of what this engine
actually did: the prefill rate and each tier's read rate (bytes per second of its reads; `kv_runtime.read_probe`
measures one read of each tier when the engine starts, before any request needs it).

The prefill rate is in FLOP/s of the model's prefill arithmetic (`ModelShape.prefill_flops`: the weights' 2 x params
per token plus attention over every earlier token), so a block deep in a long prompt, whose tokens attend to all
before them, is priced at what it costs there, not at an average token's cost; without a model shape it is plain
tokens per second. Steps that computed fewer than `MIN_PREFILL_TOKENS` prompt tokens are not counted.

For a prompt whose next blocks sit below the device, it loads the longest leading run whose loading saves time
overall and computes the rest: block i saves ``its prefill work / prefill rate - block bytes / its tier's read
rate``. Until both rates are measured the blocks are loaded (what the engine did before it knew better).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy.cost_benefit import ModelShape

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
    Observed on the engine thread (prefill, reads at admission) and a loader thread (prefetch reads).

    `shape`: prices prefill work in FLOPs by position (None: every token costs the same)."""

    block_tokens: int
    block_nbytes: int
    shape: ModelShape | None = None
    prefill: Rate = field(default_factory=Rate)  # FLOP/s with a shape, tokens/s without
    reads: dict[int, Rate] = field(default_factory=dict)  # tier level (1 = fastest lower tier) -> bytes per second
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def work(self, tokens: int, context: int) -> float:
        """Prefill work of `tokens` prompt tokens after `context` earlier ones: FLOPs with a shape, else tokens."""
        return float(tokens) if self.shape is None else self.shape.prefill_flops(tokens, context)

    def observe_prefill(self, spans: Sequence[tuple[int, int]], seconds: float) -> None:
        """One step that computed prompt tokens: `spans` = (tokens, context before them) per sequence."""
        if sum(tokens for tokens, _ in spans) >= MIN_PREFILL_TOKENS and seconds > 0:
            work = sum(self.work(tokens, context) for tokens, context in spans)
            with self._lock:
                self.prefill.observe(work, seconds)

    def observe_read(self, level: int, nbytes: int, seconds: float) -> None:
        if nbytes >= MIN_READ_BYTES and seconds > 0:
            with self._lock:
                self.reads.setdefault(level, Rate()).observe(nbytes, seconds)

    def prefill_s(self, tokens: int, context: int) -> float | None:
        """Expected seconds to compute `tokens` prompt tokens after `context` (None: not measured yet)."""
        rate = self.prefill.per_s
        return None if rate is None else self.work(tokens, context) / rate

    def saving_s(self, level: int, block: int = 0) -> float | None:
        """Seconds loading block number `block` of a prompt from tier `level` saves against computing it
        (None: not measured yet)."""
        read = self.reads.get(level)
        compute = self.prefill_s(self.block_tokens, block * self.block_tokens)
        if compute is None or read is None or read.per_s is None:
            return None
        return compute - self.block_nbytes / read.per_s

    def worth_reading(self, levels: Sequence[int], tokens: int, context: int) -> bool:
        """Whether reading blocks from tiers `levels` (one entry per block) is faster than computing the `tokens`
        prompt tokens after `context` they stand for, all or none (a hybrid hit: its blocks cover more tokens than
        they number); True while a rate is unmeasured."""
        compute = self.prefill_s(tokens, context)
        if compute is None:
            return True
        seconds = 0.0
        for level in levels:
            read = self.reads.get(level)
            if read is None or read.per_s is None:
                return True
            seconds += self.block_nbytes / read.per_s
        return seconds < compute

    def blocks_to_load(self, levels: Sequence[int], first_block: int = 0) -> int:
        """Of a prompt's next blocks below the device (`levels[i]`: the tier holding block ``first_block + i``), how
        many leading ones to load: the run whose loading saves the most time in all (every one while a rate is
        unmeasured)."""
        best = best_at = total = 0.0
        for i, level in enumerate(levels):
            saving = self.saving_s(level, first_block + i)
            total += saving if saving is not None else float("inf")
            if total >= best:
                best, best_at = total, i + 1
        return int(best_at)
