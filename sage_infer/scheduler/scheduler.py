"""Continuous batching under a per-step token budget, and the bookkeeping after each step.

`schedule()`: running sequences first (decodes and unfinished prefill chunks), preempting
the lowest-priority running sequence by recompute when the pool is short; then waiting
sequences are admitted (prefix hits first) while budget, seats and blocks last; one whose next prompt blocks
another sequence computes in the same step takes them as computed (requests behind one new system prompt
compute it once, all in the first step: `_computed_this_step`). Under
`short_prefill_first`, a step in which a short prompt can compute holds the long ones back.

With a speculative `proposer`, a decode row also carries the tokens proposed to follow it
(`Sequence.draft_token_ids`): they count against the step's token budget and get KV blocks like
any other token, and are dropped before anything is preempted for them.

After the model ran: `postprocess()` accounts the computed KV (registering full blocks for
reuse) and rolls back the KV of proposals the target rejected; `append_token()` adds one
sampled token, finishing the sequence on a stop token or a length limit and starting the
siblings of an `n > 1` request once its first sequence has computed the shared prompt.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sage_infer.config.serve import SchedulerConfig
from sage_infer.core.sequence import Sequence, SequenceStatus
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.prefix_reuse.index import PrefixMatch
from sage_infer.spec_decode import Proposer
from sage_infer.spec_decode.grammar import grammar_allowed


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


LPM_MAX_QUEUE = 128  # lpm orders a waiting queue up to this long (SGLang's cut-off); longer ones go by arrival


class Scheduler:
    """Decides what runs each step and keeps sequence state consistent after it ran.

    `max_model_len` and the pool bound how long a sequence may grow: a sequence alone
    always fits, so preemption can never livelock. `eos_token_ids` end a sequence unless
    its request sets `ignore_eos`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        pool_tokens = kv.block_manager.num_blocks * kv.block_size
        self.max_total_tokens = min(max_model_len, pool_tokens)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # kept in service order
        self.running: list[Sequence] = []  # kept in service order; the last is preempted first
        self._siblings: dict[str, list[Sequence]] = {}  # request id -> sequences waiting for its prompt
        self.deferred = 0  # admissions put off a step: their next prompt block was computed in it, not takeable
        self._held: set[int] = set()  # long prompts held back last step for a short one (short_prefill_first)
        self.num_preemptions = 0  # running sequences sent back to wait (their KV freed, recomputed later)

    def _order(self, seq: Sequence) -> tuple:
        """Lower sorts first. fifo and lpm: arrival; priority: (priority, arrival) — lower value is served first.
        (lpm reorders by cached prefix at admission: `_admission_order`.)"""
        if self.config.strategy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order)
        self.kv.prefetch(seq)  # a prefix in a lower KV tier starts loading while it waits

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences. Siblings of an n>1 request start once the first has
        computed the prompt, so they take its prompt blocks from the prefix cache."""
        self.add(seqs[0])
        if len(seqs) > 1:
            self._siblings[seqs[0].request_id] = list(seqs[1:])

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_busy(self) -> bool:
        """KV work in flight that must keep the engine stepping (held or expected prefill/decode transfers)."""
        return self.kv.busy

    def poll_kv(self) -> None:
        """Before scheduling: take what the KV sources finished in the background (loads, transfers, tier faults)."""
        self.kv.poll()

    def wait_for_kv(self, timeout: float) -> None:
        """Nothing could be scheduled: sleep until a load or transfer finishes, or `timeout` passes."""
        self.kv.wait_for_loads(timeout)

    # -- schedule -------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks (registered ones stay cached) and queue it again."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _chunk(self, remaining: int, budget: int, cap: int = 0) -> int:
        """Tokens of `remaining` to compute this step under `budget` and, when chunking, at most `cap` (0: no
        cap) of one request (0: not this step)."""
        if self.config.enable_chunked_prefill:
            return min(remaining, budget, cap or remaining)
        if remaining <= budget:
            return remaining
        # without chunking a long prompt runs alone, over budget, rather than never
        return remaining if budget == self.config.max_num_batched_tokens else 0

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # a long prompt is cut to the threshold only when someone else could use the rest of the step (vLLM's rule)
        others = len(self.running) + len(self.waiting) > 1
        cap = self.config.long_prefill_token_threshold if self.config.enable_chunked_prefill and others else 0
        # short_prefill_first: prompts within the cap are short (alone, there is nobody to hold back)
        short = cap if self.config.short_prefill_first else 0
        held, self._held = self._held, set()
        if short and not self._short_prefill_ready(short):
            short = 0
        queue = sorted(self.running, key=self._order)
        self.running = []
        limit = self.proposer.disable_by_batch_size if self.proposer is not None else None
        speculate = self.proposer is not None and (limit is None or len(queue) < limit)
        proposals = self._propose(queue, budget) if speculate else {}
        while queue:
            seq = queue.pop(0)
            num_new = self._chunk(seq.num_uncomputed_tokens, budget, cap)
            if short and seq.num_uncomputed_tokens > short and seq.seq_id not in held:
                self._held.add(seq.seq_id)
                num_new = 0
            if num_new == 0:
                self.running.append(seq)
                continue
            if num_new == 1 and seq.seq_id in proposals:
                seq.draft_token_ids = grammar_allowed(seq, proposals[seq.seq_id][:budget - 1])
                num_new += len(seq.draft_token_ids)
            while not self.kv.allocate(seq, num_new):
                if seq.draft_token_ids:  # proposals are the first thing to go when the pool is short
                    seq.draft_token_ids = []
                    num_new = 1
                    continue
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
        computing = [(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens) if n > 1]
        candidates = self._admission_order()
        position = 0
        while position < len(candidates) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = candidates[position]
            if self.kv.is_loading(seq):  # its prefix is still coming from a lower tier: the others go first
                position += 1
                continue
            match = self.kv.match(seq)  # records nothing: a request that must wait is not counted again
            if short and seq.num_tokens - match.total_tokens > short and seq.seq_id not in held:
                self._held.add(seq.seq_id)
                position += 1
                continue
            borrowed = self._computed_this_step(seq, match, computing)
            if borrowed is None:
                self.deferred += 1
                position += 1  # next step its prefix is cached; the others go first
                continue
            num_new = self._chunk(seq.num_tokens - match.total_tokens - len(borrowed) * self.kv.block_size, budget,
                                  cap)
            if num_new == 0 or not self.kv.admit(seq, match, num_new, borrowed):
                break
            candidates.pop(position)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
            if num_new > 1:
                computing.append((seq, num_new))
        return batch

    def _short_prefill_ready(self, limit: int) -> bool:
        """Whether a prompt with at most `limit` tokens left to compute can run this step: a running one whose
        prefill is unfinished, or one of the first LPM_MAX_QUEUE waiting ones that is not loading from a lower
        tier (its cached prefix counted), while a seat is free."""
        if any(1 < seq.num_uncomputed_tokens <= limit for seq in self.running):
            return True
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return any(seq.num_tokens - self.kv.match(seq).total_tokens <= limit
                   for seq in self.waiting[:LPM_MAX_QUEUE] if not self.kv.is_loading(seq))

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences in the order admission tries them: the queue's (arrival or priority), or under lpm
        those that waited `lpm_max_wait_s` or longer first (arrival order), then the most prompt tokens cached
        first (device and lower tiers; arrival among equals). A longer queue than LPM_MAX_QUEUE keeps arrival
        order: matching every waiting prompt each step would cost more than it saves."""
        if self.config.strategy != "lpm" or not 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            return list(self.waiting)
        overdue = time.monotonic() - self.config.lpm_max_wait_s
        late = [seq for seq in self.waiting if seq.arrival_time <= overdue]
        fresh = [seq for seq in self.waiting if seq.arrival_time > overdue]
        cached = {seq.seq_id: self.kv.match(seq).total_tokens for seq in fresh}
        return late + sorted(fresh, key=lambda seq: -cached[seq.seq_id])  # stable: the queue's order among equals

    def _propose(self, queue: list[Sequence], budget: int) -> dict[int, list[int]]:
        """The proposer's tokens to follow each decode row of `queue`, by seq id, asked for all rows at once (a
        draft model runs one forward per draft token for all of them). Each row's are no more than the step's
        budget after its first token (the step loop cuts them to what is left when it gets there), and no more
        than the sequence may still emit after this step's first token (its `max_tokens`, the context), so a
        verify row never runs past the end."""
        rows = []
        for seq in queue:
            if seq.num_uncomputed_tokens != 1:
                continue
            room = self.max_total_tokens - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            rows.append((seq.seq_id, seq.token_ids, min(budget - 1, room), seq.extra_key))
        return {row[0]: tokens for row, tokens in zip(rows, self.proposer.propose_batch(rows))}

    def _computed_this_step(self, seq: Sequence, match: PrefixMatch,
                            computing: list[tuple[Sequence, int]]) -> tuple[int, ...] | None:
        """The blocks of `seq`'s prompt past its cached prefix that another sequence computes in this step (the
        same tokens from the start, the same prefix-cache key), for `seq` to take as computed: 64 requests behind
        one new system prompt compute it once, in the first request, and all 64 attend it in that same step.
        Empty when no such sequence exists. None when one does but its blocks cannot be taken (`takes_in_step`:
        a lower-tier hit; `lend`: its blocks before them are not the ones `seq` found; or that sequence computes
        only part of what the two share this step): then `seq` waits a step and finds them cached, rather than
        compute them a second time."""
        bs = self.kv.block_size
        cached = match.total_tokens
        end = cached + bs  # the tokens up to and including the next block
        if self.kv.index is None or not computing or end > seq.num_tokens - 1:
            return ()
        prefix = seq.token_ids[:end]
        for other, n in computing:
            if not (other.num_computed_tokens <= cached and other.num_computed_tokens + n >= end
                    and other.extra_key == seq.extra_key and other.token_ids[:end] == prefix):
                continue
            first = cached // bs
            if not self.kv.takes_in_step(seq, match):
                return None
            last = min((seq.num_tokens - 1) // bs, len(other.token_ids) // bs)  # a token is left to compute
            shared = first + 1
            while shared < last and other.token_ids[shared * bs:(shared + 1) * bs] == \
                    seq.token_ids[shared * bs:(shared + 1) * bs]:
                shared += 1
            if shared * bs > other.num_computed_tokens + n:  # the rest of what they share comes in later steps
                return None
            return self.kv.lend(other, match, first, shared)
        return ()

    # -- after the step -------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, accepted: Mapping[Sequence, int] | None = None) -> None:
        """Account this step's KV for every scheduled sequence. A sequence with proposals keeps the KV of its
        first row and of the `accepted[seq]` proposals the target agreed with; the blocks past that go back to
        the pool (rows the target rejected wrote there; the rest of the last kept block is overwritten by later
        steps). Only then are newly full blocks registered for reuse: never one holding a rejected token.
        The sampled tokens follow, one `append_token` each."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            drafts = seq.draft_token_ids
            if not drafts:
                seq.num_computed_tokens += n
                self.kv.commit(seq)
                continue
            kept = (accepted or {}).get(seq, 0)
            seq.num_computed_tokens += n - (len(drafts) - kept)
            seq.draft_token_ids = []
            self.kv.trim(seq)
            self.kv.commit(seq, seq.token_ids + drafts[:kept] if kept else None)

    def append_token(self, seq: Sequence, token: int) -> bool:
        """Append one sampled token to a running `seq`; finish it on a stop token (`stop_token_ids`, or EOS unless
        `ignore_eos`) or a length limit (`max_tokens`, the context or the pool). Whether it finished. Stop strings
        need the text: the engine's output processing ends those with `finish`."""
        seq.token_ids.append(token)
        siblings = self._siblings.pop(seq.request_id, None)
        if siblings:
            for sibling in siblings:
                self.add(sibling)
        params = seq.params
        if token in params.stop_token_ids:
            self.finish(seq, "stop", token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self.finish(seq, "stop")
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self.finish(seq, "length")
        elif seq.num_tokens >= self.max_total_tokens:
            self.finish(seq, "length")
        return seq.is_finished

    def end_step(self) -> None:
        """After a step's tokens are appended: with no request waiting, bring hot lower-tier blocks back
        before they are asked for."""
        if not self.waiting:
            self.kv.promote_hot()

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Take a finished or aborted sequence out, release its blocks and record why it ended."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            siblings = self._siblings.get(seq.request_id)
            if siblings and seq in siblings:
                siblings.remove(seq)
                if not siblings:
                    del self._siblings[seq.request_id]
        if seq.hold_kv and reason != "abort":
            self.kv.hold(seq)  # a decode instance takes its KV; freed once sent (or the hold expires)
        else:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.draft_token_ids = []
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id, seq.extra_key, seq.output_token_ids)
        seq.finish_time = time.monotonic()
