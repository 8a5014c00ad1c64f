"""The scheduler side of the connector as plain logic: which blocks to load and save each step.

vLLM calls the scheduler-side connector with its own objects; `connector.py` turns them into
the arguments below, so everything deciding *what* moves is testable without vLLM.

Per request the planner keeps the chain of store keys of its full blocks and
`num_stored_blocks`: how many leading blocks the store holds or a save is already planned
for. A step saves every full block past that whose KV is computed and whose tokens are
known (with async scheduling the token of the last computed slot may not be known yet:
that block is saved the step after). A request that finishes with such a block unsaved
keeps its blocks until a last save copies them (`finished` returns True).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.integrations.vllm.keys import KeySpace, extend_chain
from sage_infer.integrations.vllm.pd_transfer import HoldIO, PullIO
from sage_infer.kv_policy.cost_benefit import ModelShape


@dataclass(slots=True)
class BlockIO:
    """Blocks of one request to move: vLLM block ids and their store keys, in chain order."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    first: int = 0  # chain position of keys[0]
    parent: bytes | None = None  # the key before keys[0] in the chain
    tenant: bytes = b""  # the request's extra key (its cache_salt's tenant, for quotas)


@dataclass(slots=True)
class StepPlan:
    """One step's transfers, sent from the scheduler to the worker in vLLM's per-step metadata."""

    loads: list[BlockIO] = field(default_factory=list)
    saves: list[BlockIO] = field(default_factory=list)
    # requests vLLM keeps the blocks of until this step's saves are copied out (`request_finished`)
    finished_saves: list[str] = field(default_factory=list)
    holds: list[HoldIO] = field(default_factory=list)  # producer: prompt blocks to copy out for a consumer
    drops: list[bytes] = field(default_factory=list)  # keys the disk store's eviction policy evicted
    pulls: list[PullIO] = field(default_factory=list)  # consumer: held blocks to ask a producer for


@dataclass(slots=True)
class ScheduledRequest:
    """What the planner needs of one request scheduled this step."""

    req_id: str
    token_ids: Sequence[int]  # every token known so far (prompt + output)
    num_computed_tokens: int  # after this step's forward
    block_ids: Sequence[int]  # the request's vLLM block table (group 0)


@dataclass(slots=True)
class _Request:
    extra_key: bytes
    keys: list[bytes] = field(default_factory=list)
    num_stored_blocks: int = 0
    local_tokens: int = 0  # vLLM's own prefix-cache hit when matched (block-aligned)
    prompt_tokens: int = 0  # tokens known when matched
    load: BlockIO | None = None


class ConnectorPlanner:
    """Matches prompts against the store and plans each step's loads and saves."""

    def __init__(self, block_size: int, key_space: KeySpace, save_decode: bool = True) -> None:
        self.block_size = block_size
        self.key_space = key_space
        self.save_decode = save_decode
        self._requests: dict[str, _Request] = {}
        self._finishing: list[BlockIO] = []

    def match(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],  # every token known (a resumed request's outputs too)
        cache_salt: str | None,
        num_computed_tokens: int,
        lookup: Callable[[list[bytes]], int],
    ) -> int:
        """Tokens past `num_computed_tokens` the store can fill: whole blocks, never the prompt's last token.

        `lookup(keys)` is how many leading keys the store holds. Calling again for the same
        request replaces what the last call decided (vLLM may ask more than once).
        """
        bs = self.block_size
        state = _Request(self.key_space.extra_key(cache_salt))
        old = self._requests.get(req_id)
        if old is not None and old.extra_key == state.extra_key:
            state.keys = old.keys  # the prompt does not change; keep the hashes
        max_blocks = max(len(prompt_token_ids) - 1, 0) // bs  # the last token is computed for its logits
        extend_chain(state.keys, prompt_token_ids, max_blocks, bs, state.extra_key)
        hit_blocks = lookup(state.keys[:max_blocks]) if max_blocks else 0
        state.num_stored_blocks = hit_blocks
        state.local_tokens = num_computed_tokens - num_computed_tokens % bs
        state.prompt_tokens = len(prompt_token_ids)
        self._requests[req_id] = state
        return max(0, hit_blocks * bs - num_computed_tokens)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> BlockIO | None:
        """vLLM gave the request `block_ids`; plan the load of `num_external_tokens` if any (returned)."""
        state = self._requests.get(req_id)
        if state is None or num_external_tokens <= 0:
            return None
        assert num_external_tokens % self.block_size == 0, "the connector only offers whole blocks"
        first = state.local_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        assert last <= min(len(block_ids), state.num_stored_blocks), "vLLM loads more than was matched"
        state.load = BlockIO(req_id, list(block_ids[first:last]), state.keys[first:last])
        return state.load

    def plan_step(self, scheduled: Iterable[ScheduledRequest]) -> StepPlan:
        """The loads allocated since the last step and the saves of blocks this step completes."""
        plan = StepPlan(saves=self._finishing)
        plan.finished_saves = [io.req_id for io in self._finishing]
        self._finishing = []
        for req in scheduled:
            state = self._requests.get(req.req_id)
            if state is None:
                continue
            if state.load is not None:
                plan.loads.append(state.load)
                state.load = None
            save = self._plan_save(req.req_id, state, req.token_ids, req.num_computed_tokens, req.block_ids)
            if save is not None:
                plan.saves.append(save)
        return plan

    def finished(
        self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int, block_ids: Sequence[int]
    ) -> bool:
        """The request is done: True when a last save is planned and vLLM must keep its blocks until then."""
        state = self._requests.pop(req_id, None)
        if state is None:
            return False
        save = self._plan_save(req_id, state, token_ids, num_computed_tokens, block_ids)
        if save is None:
            return False
        self._finishing.append(save)
        return True

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def _plan_save(
        self, req_id: str, state: _Request, token_ids: Sequence[int], num_computed: int, block_ids: Sequence[int]
    ) -> BlockIO | None:
        full = min(num_computed, len(token_ids), len(block_ids) * self.block_size) // self.block_size
        if not self.save_decode:
            full = min(full, state.prompt_tokens // self.block_size)  # the prompt's blocks only
        if full <= state.num_stored_blocks:
            return None
        extend_chain(state.keys, token_ids, full, self.block_size, state.extra_key)
        first, state.num_stored_blocks = state.num_stored_blocks, full
        return BlockIO(req_id, list(block_ids[first:full]), state.keys[first:full], first,
                       state.keys[first - 1] if first else None, state.extra_key)


def admit(io: BlockIO, worth: Callable[[int], bool]) -> BlockIO:
    """Admission: `io`'s blocks from the first one `worth(chain position)` admits (the cost model's verdict grows
    with depth: a shallow block is cheap to recompute). The rest of the chain is kept whole, so what is saved
    stays a run of consecutive blocks."""
    skip = 0
    while skip < len(io.keys) and not worth(io.first + skip):
        skip += 1
    if not skip:
        return io
    return BlockIO(io.req_id, io.block_ids[skip:], io.keys[skip:], io.first + skip, io.keys[skip - 1], io.tenant)


def model_shape(hf_config: Any, schema: KVCacheSchema) -> ModelShape:
    """What the cost model needs of a model vLLM serves: the KV shape, and its parameter count estimated from the
    config (attention and gated-MLP weights per layer plus the embedding), since vLLM has not loaded it yet."""
    hidden, layers = hf_config.hidden_size, schema.num_layers
    inter = getattr(hf_config, "intermediate_size", 4 * hidden)
    heads = hf_config.num_attention_heads
    attention = hidden * (heads + 2 * schema.num_kv_heads) * schema.head_dim + heads * schema.head_dim * hidden
    params = layers * (attention + 3 * hidden * inter) + hf_config.vocab_size * hidden
    return ModelShape(num_layers=layers, hidden=hidden, num_kv_heads=schema.num_kv_heads, head_dim=schema.head_dim,
                      dtype_bytes=schema.dtype.bits / 8, num_params=float(params))
