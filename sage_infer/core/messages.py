"""Typed messages between the front end (HTTP server, CLI) and an engine.

Commands travel to the engine (`AddRequest`, `AbortRequest`); snapshots come back
(`EngineStats`, `ModelInfo`, `HealthStatus`). Plain dataclasses with slots, so a
command queue never carries a bare tuple whose meaning lives in its position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sage_infer.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """Prefill/decode separation for one request (`kv_runtime/transfers.py`)."""

    hold: bool = False  # prefill: keep the prompt's KV when the request ends, until it is sent or expires
    transfer_id: str | None = None  # decode: the prompt's KV arrives as this transfer; compute only the rest
    schema_digest: str | None = None  # the sender's KV schema (hex); a different one here is an error
    connector: dict | None = None  # decode through a backend's own KV connector (vLLM): the prefill's answer


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Run one request. `prompt_token_ids` are already validated by the sender: non-empty,
    every id in ``[0, vocab_size)``, shorter than the model's context. The engine does not
    tokenize or re-check them token by token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text the ids came from, when there was one (reported back)
    priority: int = 0  # lower is served first when the scheduler runs in priority mode
    cache_salt: str | None = None  # isolates cached prefixes between tenants
    arrival_time: float | None = None  # time.monotonic(); None: when the engine receives it
    kv_transfer: KVTransferParams | None = None  # prefill/decode separation


@dataclass(frozen=True, slots=True)
class SendKV:
    """Prefill role: send a finished, held request's prompt KV to a decode instance's connector."""

    request_id: str
    address: str  # the decode instance's KV connector (KVTransferInfo.address there)
    transfer_id: str  # what the decode instance expects it as
    kv_dtype: str | None = None  # the decode instance's KV dtype when it differs (the blocks are converted)


@dataclass(frozen=True, slots=True)
class GiveUpKV:
    """Decode role: the KV a request waits for will not come (its sender failed); compute the prompt."""

    transfer_id: str
    why: str


@dataclass(frozen=True, slots=True)
class KVTransferInfo:
    """What an instance with a prefill/decode role tells its peers."""

    role: str  # prefill | decode
    address: str | None  # decode: where prefill instances send KV
    schema_digest: str  # the KV block shape (hex); prefill and decode must agree
    kv_dtype: str | None = None  # this instance's KV dtype; a decode instance in another one gets converted blocks


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request and free its KV blocks; its final output says finish_reason ``abort``."""

    request_id: str


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One lower KV tier (host, disk, remote) as the engine sees it right now."""

    name: str
    blocks: int
    bytes: int
    capacity_bytes: int
    demoted_blocks: int  # blocks moved down into this tier
    loaded_blocks: int  # blocks moved up from it into the device
    errors: int  # calls to it that failed (unreachable backend)
    checksum_failures: int  # blocks read back corrupt (recomputed)
    up: bool  # False while the tier rests after a failure (its blocks are recomputed meanwhile)
    down_reason: str | None = None
    written_through_blocks: int = 0  # device blocks copied into it by tiers.write_policy write_through(_selective)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine's load and KV cache, read at call time."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests (0..1)
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0  # held by no request, kept for prefix reuse
    block_size: int = 0
    block_bytes: int = 0  # bytes of one KV block (all layers, K and V)
    prefix_caching: bool = False
    prefix_queries: int = 0  # prefix lookups since start
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # prompt tokens found there
    prefix_lower_hit_tokens: int = 0  # prompt tokens loaded from a lower KV tier instead (not in prefix_hit_tokens)
    prefix_same_step_tokens: int = 0  # prompt tokens taken from blocks another request computed in the same step
    tiers: tuple[TierSnapshot, ...] = ()  # lower KV tiers, fastest first
    tier_dropped_blocks: int = 0  # evicted blocks no tier kept
    tier_load_failures: int = 0  # blocks a lookup found below but no tier returned verified
    prefetch_issued: int = 0  # lower-tier loads started when a request was queued
    prefetch_used: int = 0  # of those, claimed at admission with at least one verified block
    prefetch_timeouts: int = 0  # past the load deadline at admission: recomputed instead
    prefetch_wasted: tuple[tuple[str, int], ...] = ()  # (timeout|dropped|evicted, prefetches that ended unused)
    prefetch_bytes: int = 0  # bytes prefetches moved out of the lower tiers
    prefetch_wasted_bytes: int = 0  # of those, bytes no request used
    tier_load_failure_reasons: tuple[tuple[str, int], ...] = ()  # (miss|corrupt|error|timeout, blocks)
    tier_load_latency: tuple[tuple[float, int], ...] = ()  # cumulative (upper bound s, reads), last +Inf
    tier_load_latency_sum: float = 0.0  # seconds, all reads
    # load or compute (kv_policy/load_or_compute.py): what it measured; None where it has not yet
    tier_read_bytes_per_s: tuple[tuple[str, float], ...] = ()  # (tier, its reads' moving average)
    prefill_step_fixed_s: float | None = None  # the fitted prefill step line: fixed part, seconds
    prefill_marginal_flops: float | None = None  # its slope as FLOP/s (tokens/s without a model shape; inf: flat)
    tier_load_fixed_s: float | None = None  # a load's own engine time at admission: fixed part, seconds
    tier_load_block_s: float | None = None  # and per block loaded, seconds
    hot_promoted: int = 0  # hot blocks loaded back into free device blocks ahead of need
    hot_used: int = 0  # of those, hit by a later request
    hot_wasted: int = 0  # of those, evicted again before any request hit them
    request_failures: int = 0  # requests the engine failed alone on an unexpected error (each one, not the engine)
    num_preemptions: int = 0  # running sequences sent back to wait, their KV freed (vLLM's num_preemptions)
    # speculative decoding (none when off): verify groups, tokens proposed, tokens accepted, accepted by position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    quota_blocks: tuple[tuple[str, str, int], ...] = ()  # (tier, tenant, blocks held) with tenant quotas
    quota_events: tuple[tuple[str, str, str, int], ...] = ()  # (tier, tenant, min|max|self_evict, count)
    kv_transfer_role: str | None = None  # prefill | decode (prefill/decode separation), None otherwise
    # (direction send|receive, transfers ok, failed, bytes, seconds, KV dtype conversion seconds) of
    # prefill/decode KV transfers
    kv_transfers: tuple[tuple[str, int, int, int, float, float], ...] = ()
    kv_transfer_expired_holds: int = 0  # prefill: held KV no decode instance asked for in time
    kv_transfer_hash_mismatches: int = 0  # decode: transfers whose block hashes differed from the prompt's
    # mixture-of-experts models: (layer, expert, tokens routed to it since start), each sparse layer's every expert
    moe_expert_tokens: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a front end needs to validate and render requests for the served model."""

    name: str
    tokenizer: Any  # encode/decode/apply_chat_template, as sage_infer.models.tokenizer.Tokenizer
    chat_template: str | dict[str, str] | None
    vocab_size: int
    max_model_len: int
    # no tokenization of the model yields a token covering more prompt bytes than this, so
    # ``len(text.encode()) / max_bytes_per_token`` bounds the token count from below;
    # None when the tokenizer gives no such guarantee
    max_bytes_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class HealthStatus:
    """Whether the engine can serve; `reason` says why not."""

    ok: bool
    reason: str | None = None
    degraded: dict[str, str] = field(default_factory=dict)  # part -> why (e.g. a KV tier that is down)
