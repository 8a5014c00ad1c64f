"""One request crossing into vLLM: sage's sampling settings in vLLM's terms, and vLLM's streamed
deltas turned back into sage's `RequestOutput`s (cumulative text and tokens plus the step's delta,
logprobs in sage's shape, timings on this process's monotonic clock)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from vllm import SamplingParams as VLLMSamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from sage_infer.core.messages import AddRequest
from sage_infer.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.structured_outputs import StructuredOutputsParams as SageStructuredOutputs


def sampling_params(params: SamplingParams) -> VLLMSamplingParams:
    """sage's `SamplingParams` as vLLM's, streaming deltas. Greedy (temperature 0 or top_k 1) is
    vLLM's temperature 0 (its argmax path); sage's top_k -1 (off) is vLLM's 0."""
    greedy = params.greedy
    return VLLMSamplingParams(
        n=params.n, max_tokens=params.max_tokens,
        temperature=0.0 if greedy else params.temperature,
        top_k=0 if greedy or params.top_k == -1 else params.top_k,
        top_p=1.0 if greedy else params.top_p, min_p=0.0 if greedy else params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, seed=params.seed, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens, logprobs=params.logprobs,
        output_kind=RequestOutputKind.DELTA, structured_outputs=structured_outputs(params.structured_outputs),
    )


def structured_outputs(spec: SageStructuredOutputs | None) -> StructuredOutputsParams | None:
    """sage's output constraint as vLLM's (its own grammar backend compiles it; a Lark grammar goes to its
    llguidance backend)."""
    if spec is None:
        return None
    value = {"json": lambda: json.loads(spec.spec), "json_object": lambda: True, "regex": lambda: spec.spec,
             "choice": lambda: json.loads(spec.spec), "grammar": lambda: spec.spec}[spec.kind]()
    return StructuredOutputsParams(**{spec.kind: value}, disable_any_whitespace=not spec.whitespace_flexible)


def logprob_entries(token_ids: list[int], entries, top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """vLLM's per-token ``{token_id: Logprob(logprob, rank)}`` (the sampled token plus the top
    ``top_n``) as sage's ``(sampled logprob, [(token_id, logprob) of the top top_n, best first])``."""
    out = []
    for token_id, by_id in zip(token_ids, entries):
        top = sorted(((t, lp) for t, lp in by_id.items() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda item: item[1].rank)
        out.append((by_id[token_id].logprob, [(t, lp.logprob) for t, lp in top]))
    return out


@dataclass(slots=True)
class VLLMRequest:
    """One request: where its outputs go (a queue on the caller's loop) and what it produced so far."""

    request: AddRequest
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    metrics: RequestMetrics
    text: list[str]
    token_ids: list[list[int]]
    logprobs: list[list | None]
    finish: list[tuple[str | None, str | int | None]]
    opened: bool = False  # vLLM has it
    abort_asked: bool = False  # abort came while vLLM was still taking it
    finished: bool = False
    kv_transfer_params: dict | None = None  # what vLLM's KV connector answered when the request finished
    pump: asyncio.Task | None = field(default=None, repr=False)

    @classmethod
    def of(cls, request: AddRequest, loop: asyncio.AbstractEventLoop) -> VLLMRequest:
        """A request whose outputs go to a new queue on `loop` (the caller's)."""
        n = request.params.n
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        logprobs = [[] if request.params.logprobs is not None else None for _ in range(n)]
        return cls(request, loop, asyncio.Queue(), RequestMetrics(arrival_time=arrival), [""] * n,
                   [[] for _ in range(n)], logprobs, [(None, None)] * n)

    def output(self, out) -> RequestOutput:
        """One vLLM delta as sage's output: cumulative text and tokens plus this step's delta."""
        now = time.monotonic()
        deltas: dict[int, tuple[str, list[int]]] = {}
        top_n = self.request.params.logprobs
        for c in out.outputs:
            i = c.index
            ids = list(c.token_ids)
            self.text[i] += c.text
            self.token_ids[i].extend(ids)
            if self.logprobs[i] is not None and c.logprobs:
                self.logprobs[i].extend(logprob_entries(ids, c.logprobs, top_n or 0))
            self.finish[i] = (c.finish_reason, c.stop_reason)
            deltas[i] = (c.text, ids)
        metrics = self.metrics
        if metrics.first_token_time is None and any(ids for _, ids in deltas.values()):
            metrics.first_token_time = now
        stats = out.metrics
        if metrics.first_scheduled_time is None and stats is not None and stats.scheduled_ts and stats.queued_ts:
            # engine-core timestamps (another process, same monotonic clock): the queue wait in vLLM
            metrics.first_scheduled_time = metrics.arrival_time + max(0.0, stats.scheduled_ts - stats.queued_ts)
        if out.num_cached_tokens is not None:
            metrics.num_cached_tokens = out.num_cached_tokens
        if stats is not None:
            metrics.num_preemptions = stats.num_preemptions
        self.finished = bool(out.finished)
        if self.finished:
            metrics.finish_time = now
            self.kv_transfer_params = out.kv_transfer_params
        completions = []
        for i in range(len(self.text)):
            delta_text, delta_ids = deltas.get(i, ("", []))
            reason, stop = self.finish[i]
            completions.append(CompletionOutput(
                index=i, text=self.text[i], token_ids=list(self.token_ids[i]), finish_reason=reason,
                stop_reason=stop, logprobs=list(self.logprobs[i]) if self.logprobs[i] is not None else None,
                delta_text=delta_text, delta_token_ids=delta_ids))
        request = self.request
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), completions,
                             metrics, self.finished)
