"""`InferenceBackend`: the protocol every engine adapter implements.

The native engine is the default; lmdeploy and vllm adapters import lazily and
implement the same four calls so the server and the CLI never care which runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from sage_infer.interfaces.capability import CapabilityDescriptor


@dataclass(slots=True)
class GenerateRequest:
    """One request as a backend sees it: tokens already produced by the tokenizer."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class GenerateOutput:
    """One streamed step: the tokens added since the last output of this request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_cached_tokens: int = 0


@dataclass(slots=True)
class KVStats:
    """A snapshot of a backend's KV cache state."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    block_size: int
    prefix_queries: int = 0
    prefix_hit_blocks: int = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use or cached (0..1)."""
        return 0.0 if self.num_blocks == 0 else 1.0 - self.num_free_blocks / self.num_blocks


@runtime_checkable
class InferenceBackend(Protocol):
    """What the server and CLI need from an engine."""

    name: str

    def capabilities(self) -> CapabilityDescriptor:
        """Devices, KV dtypes and features this backend offers as configured."""
        ...

    def generate(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[GenerateOutput]:
        """Stream outputs for `requests`; each request ends with one `finished` output."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it was not running."""
        ...

    def kv_stats(self) -> KVStats:
        ...
