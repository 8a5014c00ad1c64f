"""The engine loop: schedule -> run -> sample -> postprocess, one step at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import count

import torch

from sage_infer.config.auto import ResolvedValue
from sage_infer.core.kv_schema import KVDtype
from sage_infer.core.messages import AddRequest, EngineStats, ModelInfo
from sage_infer.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.engine.detokenizer import IncrementalDetokenizer
from sage_infer.engine.kv_transfer_role import KVTransferRole
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.engine.prefix_view import PrefixView
from sage_infer.engine.sampler import Sampler, skip_draws
from sage_infer.engine.session_kv import SessionKV
from sage_infer.errors import RequestError
from sage_infer.kv_policy.load_or_compute import LoadOrCompute
from sage_infer.kv_runtime.group_transfers import groups_digest
from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.kv_runtime.tiers.base import schema_digest
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.prefix_reuse.hashing import ExtraKeys
from sage_infer.scheduler.scheduler import Scheduler
from sage_infer.spec_decode import SpecDecodeStats, accept
from sage_infer.structured.constraints import StructuredOutputError
from sage_infer.structured.grammar import compiler_for
from sage_infer.structured.masks import PendingMasks, TokenMask

log = logging.getLogger("sage_infer.engine")
LOAD_POLL_S = 0.005  # an idle step waits this long for a lower-tier load before looking again

__all__ = ["EngineParts", "LLMEngine", "RequestError", "kv_schema_digest"]


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    sent_tokens: list[int] = field(default_factory=list)  # per seq: tokens already reported
    emitted: list[str] = field(default_factory=list)  # per seq: text already reported
    pending: list[str] = field(default_factory=list)  # per seq: text not yet reported


@dataclass(slots=True)
class EngineParts:
    tokenizer: Tokenizer
    runner: ModelRunner
    scheduler: Scheduler
    model_id: str
    revision: str
    kv_dtype: str
    max_model_len: int
    device: torch.device
    extra_key: ExtraKeys  # (cache_salt=None, kv_dtype=None) -> the prefix-cache key part of this engine's requests
    pd: KVTransferRole | None = None  # prefill/decode separation, for an engine with that role
    decisions: tuple[ResolvedValue, ...] = ()  # how the build chose each value, and why (`EngineBuilder`)
    load_rates: LoadOrCompute | None = None  # with KV tiers: the measured prefill rate feeds load-or-compute


def kv_schema_digest(schema, groups: KVGroups | None = None) -> str:
    """The KV block shape (layers, heads, head dim, block size, layout) and the model's KV `groups` (each one's
    window and layers) as hex: both ends of a transfer must agree. The KV dtype may differ: the sender converts
    (`KVTransfers.send`)."""
    return groups_digest(schema_digest(schema.with_dtype(KVDtype.FP32)).hex(), groups)


class LLMEngine:
    """The step loop over a model runner and a scheduler. Its prefill/decode side is `pd` (None without a role;
    `engine/kv_transfer_role.py`), what a router reads of its prefix cache `prefix` (`engine/prefix_view.py`)."""

    def __init__(self, parts: EngineParts) -> None:
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.kv = parts.scheduler.kv
        self.model_id, self.revision, self.kv_dtype = parts.model_id, parts.revision, parts.kv_dtype
        self.device = parts.device
        self.max_total_tokens = parts.scheduler.max_total_tokens  # a sequence alone always fits the pool
        self.max_model_len = parts.max_model_len
        self.extra_key = parts.extra_key
        self.pd = parts.pd
        self.decisions = parts.decisions  # every value the build decided, with its reason, in order
        self.load_rates = parts.load_rates
        self.prefix = PrefixView(self.kv.index, self.runner.pool.block_size, self.extra_key,
                                 self.runner.pool.num_blocks, getattr(self.kv, "overlap", None),
                                 getattr(self.kv, "groups", None))
        self.sessions = SessionKV(self.kv, self.extra_key)  # conversations' KV kept for their next turn
        self.kv_schema_digest = kv_schema_digest(self.runner.pool.schema, getattr(self.kv, "groups", None))
        self.sampler = Sampler()
        self.spec_stats = SpecDecodeStats()  # speculative decoding: drafts verified, tokens proposed and accepted
        self.requests: dict[str, _Request] = {}
        self._finished: set[str] = set()  # requests whose every sequence ended, not yet reported
        self._seq_ids = count()
        self._shut_down = False

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request from text (tokenized here) or token ids (checked against the
        vocabulary); raises `RequestError` (and queues nothing) if it can never run."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.model.config.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        self.add(AddRequest(request_id, token_ids, params, prompt=text, priority=priority, cache_salt=cache_salt,
                            arrival_time=arrival_time))

    def add(self, request: AddRequest) -> None:
        """Queue a request whose token ids the sender already validated (see `AddRequest`):
        no tokenizing, no per-token check. Only what the front end cannot know is checked
        here: a duplicate id, an empty prompt, a prompt the KV pool cannot hold."""
        request_id, token_ids, params = request.request_id, request.prompt_token_ids, request.params
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not token_ids:
            raise RequestError("the prompt is empty")
        limit = self.max_total_tokens
        if len(token_ids) >= limit:
            where = "the model's context" if limit == self.max_model_len else "the KV pool"
            raise RequestError(
                f"prompt has {len(token_ids)} tokens but {where} holds {limit} "
                f"(prompt + at least 1 generated token must fit)"
            )
        transfer = request.kv_transfer
        if transfer is not None:
            if self.pd is None:
                raise RequestError("kv_transfer: this engine does not transfer KV (no prefill/decode role)")
            self.pd.check(transfer, params)
        arrival = time.monotonic() if request.arrival_time is None else request.arrival_time
        extra_key = self.extra_key(request.cache_salt)
        grammars = self._grammar_matchers(params)
        seqs, detoks = [], []
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                # sibling i draws from seed + i, wrapped into the generator's 64 bits
                generator = torch.Generator(device=self.device).manual_seed((params.seed + i) % 2**64)
            seq = Sequence(next(self._seq_ids), request_id, i, list(token_ids), len(token_ids), params,
                           extra_key, priority=request.priority, cache_salt=request.cache_salt,
                           arrival_time=arrival, generator=generator, grammar=grammars[i])
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, list(token_ids), params))
        self.requests[request_id] = _Request(request_id, request.prompt, list(token_ids), seqs, detoks,
                                             RequestMetrics(arrival_time=arrival), [0] * params.n,
                                             [""] * params.n, [""] * params.n)
        if transfer is not None and transfer.hold:
            seqs[0].hold_kv = True
        self.scheduler.add_request(seqs)
        if transfer is not None and transfer.transfer_id is not None:
            self.pd.expect(seqs[0], transfer.transfer_id)

    def _grammar_matchers(self, params: SamplingParams) -> list:
        """Structured outputs: one grammar matcher per sequence of the request (None each when unconstrained).
        The constraint is compiled once per process and cached (the server's check already did, usually)."""
        if params.structured_outputs is None:
            return [None] * params.n
        try:
            compiler = compiler_for(self.tokenizer, self.runner.model.config.vocab_size)
            return [compiler.matcher(params.structured_outputs) for _ in range(params.n)]
        except StructuredOutputError as err:
            raise RequestError(f"{err.param}: {err}") from None

    def metrics_registries(self) -> list:
        """Prometheus registries of this engine's parts, for the server's /metrics (the KV pipe's transport, the
        retained conversations' KV)."""
        return (self.pd.registries() if self.pd is not None else []) + [self.sessions.registry()]

    def wake(self) -> None:
        """Cut an idle step's wait short (another thread queued work for this engine)."""
        if self.pd is not None:
            self.pd.wake()

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self._on_finished(seq)
        return True

    def shutdown(self) -> None:
        """The end of serving (no step runs after it): keep what the KV cache holds in the persistent tier, if one
        is configured, for the next start on it; stop the tiers' and transfers' background work. Once."""
        if self._shut_down:
            return
        self._shut_down = True
        start = time.monotonic()
        kept, left = self.kv.persist()
        if kept or left:
            log.warning("kept %d KV blocks in the disk tier for the next start in %.1f s%s", kept,
                        time.monotonic() - start, f"; {left} more left out (tiers.flush_on_shutdown_s ran out)"
                        if left else "")
        self.kv.close()  # the tiers' background work, the KV pipe's loop thread and sockets

    def drain_finished(self) -> list[RequestOutput]:
        """Final outputs of requests that ended outside a step (aborts while idle)."""
        return self._collect({})

    def has_unfinished_requests(self) -> bool:
        """Something to step for: a request, or KV held for or expected from another instance."""
        return self.scheduler.has_unfinished() or self.scheduler.kv_busy

    def abort_all(self) -> None:
        """End every request (the server's shutdown): each gets its last output from `drain_finished`."""
        for request_id in list(self.requests):
            self.abort_request(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests' sequences queued and not yet running."""
        return self.scheduler.num_waiting

    # -- what front ends read -----------------------------------------------------------

    def stats(self) -> EngineStats:
        """Load and KV cache counters right now. The one place that reads scheduler and
        KV internals for reporting, so a front end never reaches into them."""
        manager = self.kv.block_manager
        index = self.kv.index
        metrics = index.metrics if index is not None else None  # not `if index`: an empty index is falsy
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            kv_usage=manager.get_utilization(),
            num_blocks=manager.num_blocks,
            num_free_blocks=manager.num_free_blocks,
            num_cached_blocks=manager.num_cached_blocks,
            block_size=manager.block_size,
            block_bytes=self.runner.pool.block_nbytes,
            prefix_caching=index is not None,
            prefix_queries=metrics.queries if metrics is not None else 0,
            prefix_query_tokens=metrics.query_tokens if metrics is not None else 0,
            prefix_hit_tokens=metrics.hit_tokens if metrics is not None else 0,
            prefix_lower_hit_tokens=self.kv.lower_hit_tokens,
            prefix_same_step_tokens=self.kv.in_step_tokens,
            spec_drafts=self.spec_stats.num_drafts,
            spec_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=tuple(self.spec_stats.accepted_per_position),
            **self.kv.source_stats(),
            moe_expert_tokens=self._expert_tokens(),
            **self._quota_stats(),
            **(self.pd.stats() if self.pd is not None else {}),
        )

    def _expert_tokens(self) -> tuple[tuple[int, int, int], ...]:
        """An MoE model's tokens routed per layer and expert (`MoeForCausalLM.expert_tokens`); () for a dense one."""
        load = getattr(self.runner.model, "expert_tokens", None)
        return tuple((layer, e, n) for layer, counts in load() for e, n in enumerate(counts)) if load else ()

    def _quota_stats(self) -> dict:
        quota = self.kv.index.quota if self.kv.index is not None else None
        if quota is None:
            return {}
        snap = quota.snapshot()
        events = [(tier, tenant, kind, n) for (tier, tenant, kind), n in snap["violations"].items()]
        events += [(tier, tenant, "self_evict", n) for (tier, tenant), n in snap["self_evictions"].items()]
        return {"quota_blocks": tuple((tier, tenant, n) for (tier, tenant), n in snap["held"].items()),
                "quota_events": tuple(events)}

    def model_info(self) -> ModelInfo:
        """The served model as a front end sees it: name, tokenizer, limits."""
        return ModelInfo(
            name=self.model_id,
            tokenizer=self.tokenizer,
            chat_template=self.tokenizer.chat_template,
            vocab_size=self.runner.model.config.vocab_size,
            max_model_len=self.max_model_len,
            max_bytes_per_token=self.tokenizer.max_bytes_per_token,
        )

    # -- the loop ---------------------------------------------------------------------

    def poll(self) -> None:
        """Take what the KV sources finished in the background: the lower tiers' failures into their health and
        counters (the disk tier's writer: a full disk, a deleted directory), transfers sent or received. On the
        engine's thread: every step does, and an idle loop should."""
        self.scheduler.poll_kv()

    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> sample -> postprocess. Returns an output for every request that changed."""
        self.poll()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self.scheduler.wait_for_kv(LOAD_POLL_S)  # everything waiting is loading from a tier or a transfer
            return self._collect({})
        now = time.monotonic()
        for seq in batch.seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = seq.num_cached_tokens
        # structured outputs: the grammars' token masks are computed while the model runs
        masks = PendingMasks.start(batch.seqs, batch.num_new_tokens, self.runner.model.config.vocab_size)
        # the prompt tokens this step computes (after how many), for the load-or-compute rates
        # (not a step that waits for layer-wise loads: their copies' time would read as the step's own)
        prefill = [(n, seq.num_computed_tokens) for seq, n in zip(batch.seqs, batch.num_new_tokens)
                   if n > 1 and not seq.draft_token_ids] \
            if self.load_rates is not None and not self.runner.pool.loads_pending else None
        started = time.perf_counter()
        logits, rows = self.runner.run(batch.seqs, batch.num_new_tokens)
        emitted = self._sample(logits, [batch.seqs[i] for i in rows], masks.for_rows(rows) if masks else None)
        if prefill:  # timed to the sampled tokens: on a GPU the forward runs after its launch returns
            self.load_rates.observe_prefill(prefill, time.perf_counter() - started, len(prefill) == len(batch.seqs))
        self.scheduler.postprocess(batch, {seq: len(tokens) - 1 for seq, (tokens, _) in emitted.items()
                                           if seq.draft_token_ids})
        changed = self._append_outputs(emitted)
        self.scheduler.end_step()
        return self._collect(changed)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence],
                token_mask: TokenMask | None = None) -> dict[Sequence, tuple[list[int], list]]:
        """Sample every logits row (`rows[r]`: its sequence; a sequence with speculative proposals has one row per
        verify position, in order) and verify the proposals (`spec_decode.accept`). Per sequence: the tokens it
        emits this step and their logprobs entries (empty unless it asked)."""
        if not rows:
            return {}
        histories, drafted = [], {}
        for r, seq in enumerate(rows):
            j = r - drafted.setdefault(seq, r)  # the verify position of row r: proposals before it join the history
            histories.append(seq.output_token_ids + seq.draft_token_ids[:j] if j else seq.output_token_ids)
        # a seeded sampled row draws from its generator once per verify row; afterwards it must have drawn once
        # per emitted token, as without speculation (`skip_draws`)
        states = {seq: seq.generator.get_state() for seq in drafted
                  if seq.draft_token_ids and seq.generator is not None and not seq.params.greedy}
        out = self.sampler(logits, [s.params for s in rows], [s.prompt_token_ids for s in rows], histories,
                           [s.generator for s in rows], token_mask)
        emitted = {}
        for seq, first in drafted.items():
            drafts = seq.draft_token_ids
            target = out.token_ids[first:first + len(drafts) + 1]
            tokens = accept(drafts, target) if drafts else target
            entries = []
            if out.logprobs is not None and seq.params.logprobs is not None:
                entries = [(out.logprobs[first + j], out.top_logprobs[first + j] if out.top_logprobs else [])
                           for j in range(len(tokens))]
            if drafts:
                self.spec_stats.record(len(drafts), len(tokens) - 1)
                self.scheduler.proposer.observe(seq.seq_id, len(drafts), len(tokens) - 1)
                if seq in states and len(tokens) <= len(drafts):
                    seq.generator.set_state(states[seq])
                    skip_draws(seq.generator, logits.shape[1], len(tokens), logits.device)
            emitted[seq] = (tokens, entries)
        return emitted

    def _append_outputs(self, emitted: dict[Sequence, tuple[list[int], list]]) -> dict[str, None]:
        """Append each sequence's emitted tokens one at a time, ending it where a token does (a stop token, a
        length limit: `Scheduler.append_token`; a stop string: the detokenizer) and dropping the tokens after;
        detokenize; close finished requests. The one place a sequence ends after a step."""
        changed: dict[str, None] = {}
        now = time.monotonic()
        for seq, (tokens, entries) in emitted.items():
            request = self.requests[seq.request_id]
            changed[seq.request_id] = None
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            detok = request.detokenizers[seq.index]
            for j, token in enumerate(tokens):
                self.scheduler.append_token(seq, token)
                if entries:
                    seq.logprobs.append(entries[j])
                ended_by_token = seq.is_finished and seq.finish_reason == "stop"
                # the ending token stays in token_ids; its text only when asked for (as vLLM)
                if not ended_by_token or seq.params.include_stop_str_in_output:
                    request.pending[seq.index] += detok.step(token)
                if detok.stopped_by is not None and not ended_by_token:
                    if seq.is_finished:  # a stop string on the last allowed token: it is a stop, not a length end
                        seq.finish_reason, seq.stop_reason = "stop", detok.stopped_by
                    else:
                        self.scheduler.finish(seq, "stop", detok.stopped_by)
                if seq.grammar is not None and not seq.is_finished:
                    self._advance_grammar(seq, token)
                if seq.is_finished:
                    self._on_finished(seq)
                    break
        return changed

    def _advance_grammar(self, seq: Sequence, token: int) -> None:
        """Structured outputs: the sequence's matcher follows its output; a completed grammar ends it ("stop")."""
        if not seq.grammar.accept(token):  # the mask forbade it: a bug, never the client's doing
            log.error("request %s: token %d is outside its grammar (%s); ending it", seq.request_id, token,
                      seq.grammar.error)
            self.scheduler.finish(seq, "stop")
        elif seq.grammar.is_finished:
            self.scheduler.finish(seq, "stop")

    def _on_finished(self, seq: Sequence) -> None:
        """A sequence ended (stop, length, abort): flush its text; close the request when all ended."""
        request = self.requests[seq.request_id]
        request.pending[seq.index] += request.detokenizers[seq.index].flush()
        if all(s.is_finished for s in request.seqs):
            self._finished.add(seq.request_id)
            request.metrics.finish_time = seq.finish_time
            request.metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)

    def _collect(self, changed: dict[str, None]) -> list[RequestOutput]:
        # aborted requests with nothing sampled this step still owe a final output
        ids = list(changed) + [r for r in self._finished if r not in changed]
        return [self._output(request_id) for request_id in ids]

    def _output(self, request_id: str) -> RequestOutput:
        request = self.requests[request_id]
        completions = []
        for seq in request.seqs:
            i = seq.index
            delta_ids = seq.output_token_ids[request.sent_tokens[i]:]
            request.sent_tokens[i] = seq.num_output_tokens
            delta_text, request.pending[i] = request.pending[i], ""
            request.emitted[i] += delta_text
            completions.append(
                CompletionOutput(
                    index=i,
                    text=request.emitted[i],
                    delta_text=delta_text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    delta_token_ids=delta_ids,
                )
            )
        finished = all(s.is_finished for s in request.seqs)
        output = RequestOutput(request_id, request.prompt, request.prompt_token_ids, completions,
                               request.metrics, finished)
        if finished:
            del self.requests[request_id]
            self._finished.discard(request_id)
        return output
