"""`InferenceBackend`: what the server needs from an engine, and nothing more.

The native engine is the default; other adapters (lmdeploy, vllm) implement the same
calls so the HTTP front end never cares which runs. The front end validates and
tokenizes a request once (against `model_info()`), then hands the backend token ids in
an `AddRequest` and reads `RequestOutput`s back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from sage_infer.core.messages import (
    AddRequest,
    EngineStats,
    GiveUpKV,
    HealthStatus,
    KVTransferInfo,
    ModelInfo,
    SendKV,
)
from sage_infer.core.outputs import RequestOutput


class BackendError(Exception):
    """Base of the errors a backend raises to a front end; `str(err)` is safe to show a client."""


class InvalidRequestError(BackendError, ValueError):
    """The request can never run here (e.g. longer than the KV pool holds): a client error."""


class QueueFullError(BackendError):
    """More requests wait than the backend accepts; try again later."""


class EngineDeadError(BackendError):
    """The engine stopped after an internal error; nothing more can be served."""


@runtime_checkable
class InferenceBackend(Protocol):
    """An engine as the server sees it.

    `add_request` returns once the engine accepted the request, so a refusal can still
    become an HTTP status; the returned stream then yields the request's outputs, the
    last one with ``finished=True``. Leaving the stream early aborts the request.
    """

    name: str

    def start(self) -> None:
        """Begin serving (e.g. start the engine thread); called once, before any request."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving; requests still running are left to the caller to drain first."""
        ...

    async def add_request(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        """Queue `request`; raises `InvalidRequestError`, `QueueFullError` or `EngineDeadError`."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; its stream ends with finish_reason ``abort``. No-op if unknown."""
        ...

    def model_info(self) -> ModelInfo:
        """Name, tokenizer, chat template, vocabulary size and context length of the served model."""
        ...

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV usage and prefix-cache counters, right now."""
        ...

    def health(self) -> HealthStatus:
        """Whether the backend can serve; not ok once its engine died."""
        ...

    def on_finished(self, callback: Callable[[RequestOutput], None]) -> None:
        """Call `callback` with the final output of every request, aborted ones included
        (possibly from another thread): the server's request counters need aborts that no
        client stream is left to see."""
        ...


@runtime_checkable
class KVTransferBackend(Protocol):
    """A backend that takes part in prefill/decode separation (`sage llm serve --role`)."""

    def kv_transfer_info(self) -> KVTransferInfo | None:
        """Role, connector address and KV schema digest; None when this instance has no role."""
        ...

    async def send_kv(self, command: SendKV) -> int:
        """Send a held request's prompt KV; the number of blocks, once the receiver verified them.
        Raises `InvalidRequestError` when nothing is held under that id, `BackendError` when the
        transfer failed."""
        ...

    def give_up_kv(self, command: GiveUpKV) -> None:
        """Decode role: stop waiting for a transfer that will not come (its request computes its prompt)."""
        ...

    def prefix_overlap(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Prompt tokens whose KV is cached here now (the router's prefix-overlap score)."""
        ...

    def kv_events(self, since: int):
        """Block hashes this instance's prefix cache stored and removed since event `since` (an
        `EventBatch` with `next`, `reset`, `events`), or None when it does not log them."""
        ...

    def kv_events_read(self, since: int):
        """Every medium's (device, host, disk, remote) block events since event `since`, or the whole current set
        when `since` is out of the log's range (an `EventRead`: `next`, `reset`, `events`, `snapshot`); None when
        this instance does not log them."""
        ...

    def kv_recipe(self) -> dict | None:
        """How this instance names its blocks (block size and the extra key's parts besides the cache salt), so a
        router can hash token-id prompts as it does; None without prefix caching."""
        ...

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        """The short hashes of a prompt's blocks, as `kv_events` names them."""
        ...
