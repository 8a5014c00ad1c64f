"""One generation stream: its tokens, its KV blocks, and where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from sage_infer.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """`token_ids` is prompt + output. `num_computed_tokens` of them have KV in the pool
    (written by this sequence or found in the prefix cache); the rest are computed in
    later steps, `block_table` maps logical blocks to pool blocks."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    extra_key: bytes  # prefix-cache key part: model, revision, KV dtype, tenant salt
    priority: int = 0
    cache_salt: str | None = None  # the tenant salt in extra_key (to key the same blocks in another KV dtype)
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks, registered
    # chained hashes of token_ids' leading full blocks as far as some lookup asked (`hashing.extend_chain`),
    # registered or not: the prefix match, the tiers' lookup and registration hash each block once. A full
    # block's tokens never change once it is hashed (output tokens are only appended)
    hash_chain: list[bytes] = field(default_factory=list)
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)
    admitted_once: bool = False  # the prefix query is counted on the first admission only
    hold_kv: bool = False  # prefill/decode: its blocks outlive it, until a decode instance took them
    # speculative decoding: tokens proposed to follow token_ids, checked by this step's verify rows (their KV is
    # written after num_computed_tokens; the rows the target rejects are rolled back after the step)
    draft_token_ids: list[int] = field(default_factory=list)
    # structured outputs: this sequence's grammar matcher (`sage_infer.structured.GrammarMatcher`), advanced by
    # every token appended to the output; None when unconstrained
    grammar: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
