"""Continuous batching under a per-step token budget.

Each step: running sequences first (decodes and unfinished prefill chunks), preempting
the lowest-priority running sequence by recompute when the pool is short; then waiting
sequences are admitted (prefix hits first) while budget, seats and blocks last.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from sage_infer.config.serve import SchedulerConfig
from sage_infer.core.sequence import Sequence, SequenceStatus
from sage_infer.scheduler.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # kept in service order
        self.running: list[Sequence] = []  # kept in service order; the last is preempted first

    def _order(self, seq: Sequence) -> tuple:
        """Lower sorts first. fifo: arrival; priority: (priority, arrival) — lower value is served first."""
        if self.config.strategy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks (registered ones stay cached) and queue it again."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.add(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        # without chunking a long prompt runs alone, over budget, rather than never
        return remaining if budget == self.config.max_num_batched_tokens else 0

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        queue = sorted(self.running, key=self._order)
        self.running = []
        while queue:
            seq = queue.pop(0)
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                self.running.append(seq)
                continue
            while not self.kv.allocate(seq, num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.running.append(seq)
                batch.add(seq, num_new)
                budget -= num_new
        if batch.preempted:  # the pool is full: admitting now would only thrash
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self.kv.match_prefix(seq)
            num_new = self._chunk(seq, budget)
            if num_new == 0 or not self.kv.allocate(seq, num_new):
                self.kv.free(seq)  # give matched blocks back (they stay cached)
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        return batch

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
