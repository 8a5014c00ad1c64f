"""The native backend: sage_infer's own `LLMEngine` behind `InferenceBackend`.

The engine runs in its own thread so HTTP requests stream while others are scheduled.
The event loop never touches engine state: it puts typed commands (`AddRequest`,
`AbortRequest`) on a queue; the engine thread applies them between steps and hands
each request's outputs to that request's asyncio queue on the loop it came from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from sage_infer.backends.streams import stream_outputs
from sage_infer.config.serve import ServeConfig
from sage_infer.core.messages import (
    AbortRequest,
    AddRequest,
    EngineStats,
    GiveUpKV,
    HealthStatus,
    KVTransferInfo,
    ModelInfo,
    SendKV,
)
from sage_infer.core.outputs import RequestOutput
from sage_infer.engine.llm_engine import LLMEngine, RequestError
from sage_infer.interfaces.backend import BackendError, EngineDeadError, InvalidRequestError, QueueFullError

log = logging.getLogger("sage_infer.server")

_DEAD = "the engine stopped after an internal error; restart the server"


@dataclass(frozen=True, slots=True)
class _Retain:
    """When a request finishes, retain its context's KV under `key` (a stored conversation turn)."""

    key: str
    cache_salt: str | None
    ttl_s: float


@dataclass(frozen=True, slots=True)
class _Release:
    key: str


@dataclass(slots=True)
class _Target:
    """Where the outputs of one request go: its asyncio queue, on the loop that owns it."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    accepted: concurrent.futures.Future  # resolved once the engine took (or refused) the request


class NativeBackend:
    """`InferenceBackend` over an `LLMEngine` stepped by one background thread."""

    name = "native"

    def __init__(self, engine: LLMEngine, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[AddRequest | AbortRequest | GiveUpKV | _Release] = queue.SimpleQueue()
        self._retain: dict[str, _Retain] = {}  # request id -> what to retain when it finishes (under _lock)
        self._targets: dict[str, _Target] = {}  # every request added and not yet finished
        self._lock = threading.Lock()  # guards _targets and _pending_adds across the two threads
        self._pending_adds = 0  # added on the loop, not yet applied by the engine thread
        self.failed_adds = 0  # requests whose add raised something other than a RequestError (each one failed alone)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sage-engine", daemon=True)
        self._dead: BaseException | None = None
        self._on_finished: Callable[[RequestOutput], None] | None = None
        self._model_info = engine.model_info()
        self._kv_transfer_info = engine.pd.info() if engine.pd is not None else None

    # -- InferenceBackend ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # (a step still running owns the engine: leave it be)
            self.engine.shutdown()

    async def add_request(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(_DEAD)
        loop = asyncio.get_running_loop()
        target = _Target(loop, asyncio.Queue(), concurrent.futures.Future())
        with self._lock:
            waiting = self.engine.num_waiting + self._pending_adds
            if waiting >= self.max_waiting:
                self._retain.pop(request.request_id, None)
                raise QueueFullError(f"{waiting} requests are waiting (max {self.max_waiting})")
            if request.request_id in self._targets:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            self._targets[request.request_id] = target
            self._pending_adds += 1
        self._commands.put(request)
        self._wake.set()
        self.engine.wake()
        if self._dead is not None:  # died while we queued: no thread is left to answer
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                target.accepted.set_exception(EngineDeadError(_DEAD))
        await asyncio.wrap_future(target.accepted)
        return stream_outputs(target.outputs, lambda: self.abort(request.request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))
        self._wake.set()

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        # requests accepted on the loop but not yet handed to the scheduler wait too
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + self._pending_adds,
                                   request_failures=self.failed_adds)

    def health(self) -> HealthStatus:
        """Dead engine: not ok. A lower KV tier that is down degrades (its blocks are recomputed) but serves."""
        if self._dead is not None:
            return HealthStatus(False, _DEAD)
        down = {t.name: t.down_reason or "down" for t in self.engine.stats().tiers if not t.up}
        return HealthStatus(True, degraded=down)

    def on_finished(self, callback: Callable[[RequestOutput], None]) -> None:
        self._on_finished = callback

    # -- KVTransferBackend (prefill/decode roles) ------------------------------------------

    def kv_transfer_info(self) -> KVTransferInfo | None:
        return self._kv_transfer_info

    async def send_kv(self, command: SendKV) -> int:
        if self._dead is not None:
            raise EngineDeadError(_DEAD)
        done: concurrent.futures.Future = concurrent.futures.Future()
        # started right here, not between two engine steps (a step can take tens of ms): `KVTransfers.send`
        # is thread-safe; the engine thread frees the blocks when the receiver has verified them
        await asyncio.to_thread(self._apply_send, command, done)
        return await asyncio.wrap_future(done)

    def metrics_registries(self) -> list:
        """Registries besides the server's own that /metrics should serve (the KV connector's transport)."""
        return self.engine.metrics_registries()

    def kv_events(self, since: int):
        return self.engine.prefix.events(since)

    def kv_events_read(self, since: int):
        return self.engine.prefix.read_events(since)

    def kv_recipe(self) -> dict | None:
        return self.engine.prefix.recipe()

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        return self.engine.prefix.block_hashes(token_ids, cache_salt)

    def prefix_overlap(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        return self.engine.prefix.overlap(token_ids, cache_salt)

    def give_up_kv(self, command: GiveUpKV) -> None:
        self._commands.put(command)
        self._wake.set()
        self.engine.wake()

    # -- conversations' KV (the Responses API's stored responses) ---------------------------

    def enable_kv_retention(self, max_share: float) -> bool:
        """Let `retain_kv` keep at most `max_share` of the device pool (before `start`); False without prefix
        caching."""
        return self.engine.sessions.enable(max_share)

    def retain_kv(self, request_id: str, key: str, cache_salt: str | None, ttl_s: float) -> None:
        """When `request_id` (not yet added) finishes, not aborted, retain the KV of its prompt and output under
        `key` for `ttl_s`: eviction takes other cached blocks first."""
        with self._lock:
            self._retain[request_id] = _Retain(key, cache_salt, ttl_s)

    def release_kv(self, key: str) -> None:
        """End `key`'s retention (its blocks become ordinary cached blocks)."""
        self._commands.put(_Release(key))
        self._wake.set()

    def _retain_finished(self, output: RequestOutput) -> None:
        with self._lock:
            retain = self._retain.pop(output.request_id, None)
        if retain is None or output.error or len(output.outputs) != 1:
            return
        completion = output.outputs[0]
        if completion.finish_reason in ("stop", "length"):  # the last token's KV is never computed
            tokens = list(output.prompt_token_ids) + list(completion.token_ids[:-1])
            self.engine.sessions.retain(retain.key, tokens, retain.cache_salt, retain.ttl_s)

    # -- beyond the protocol ------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (tests wait for 0 before checking for leaks)."""
        return len(self._targets)

    # -- the engine thread --------------------------------------------------------------

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                self._apply_add(command)
            elif isinstance(command, AbortRequest):
                if self.engine.abort_request(command.request_id):
                    self._deliver(self.engine.drain_finished())
            elif isinstance(command, _Release):
                self.engine.sessions.release(command.key)
            elif isinstance(command, GiveUpKV):
                if self.engine.pd is not None:
                    self.engine.pd.give_up(command.transfer_id, command.why)

    def _apply_send(self, send: SendKV, done: concurrent.futures.Future) -> None:
        """Start the send; `done` resolves (blocks sent, or the failure) when the receiver answered.

        The result may come (on the engine thread) before `send_kv` has returned the block count
        here: whichever of the two is second resolves `done`.
        """
        lock, state = threading.Lock(), {}

        def settle() -> None:
            result = state["result"]
            if result.ok:
                done.set_result(state["blocks"])
            else:
                done.set_exception(BackendError(f"KV transfer {send.transfer_id} failed: {result.error}"))

        def finished(result) -> None:
            with lock:
                state["result"] = result
                ready = "blocks" in state
            if ready:
                settle()

        if self.engine.pd is None:
            done.set_exception(InvalidRequestError("this engine does not transfer KV (no prefill/decode role)"))
            return
        try:
            blocks = self.engine.pd.send(send.request_id, send.address, send.transfer_id, finished, send.kv_dtype)
        except RequestError as err:
            done.set_exception(InvalidRequestError(str(err)))
            return
        with lock:
            state["blocks"] = blocks
            ready = "result" in state
        if ready:
            settle()

    def _apply_add(self, command: AddRequest) -> None:
        target = self._targets[command.request_id]
        try:
            self.engine.add(command)
        except RequestError as err:
            with self._lock:
                del self._targets[command.request_id]
                self._retain.pop(command.request_id, None)
            target.accepted.set_exception(InvalidRequestError(str(err)))
        except Exception as err:  # noqa: BLE001 - a bug met by one request fails that request, not the engine
            log.exception("adding request %s failed", command.request_id)
            with contextlib.suppress(Exception):
                self.engine.abort_request(command.request_id)  # frees whatever the add had taken
            with self._lock:
                self._targets.pop(command.request_id, None)
                self._retain.pop(command.request_id, None)
            self.failed_adds += 1
            target.accepted.set_exception(BackendError(f"the engine could not add this request: {err!r}"))
        else:
            target.accepted.set_result(None)
        finally:
            with self._lock:
                self._pending_adds -= 1

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._targets.get(output.request_id)
            if target is None:
                continue
            if output.finished:
                with self._lock:
                    del self._targets[output.request_id]
                if self._retain:
                    self._retain_finished(output)
                if self._on_finished is not None:
                    self._on_finished(output)
            if not _send(target, output) and not output.finished:
                self.engine.abort_request(output.request_id)  # nobody is left to read it

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self.engine.poll()  # a tier's writer may fail after the last request
            # shutting down: nothing runs any more; apply what was sent (the drain's aborts), then end every
            # request still here, so each stream gets its last output and every block goes back to the pool
            self._apply_commands()
            self.engine.abort_all()
            self._deliver(self.engine.drain_finished())
        except BaseException as err:  # noqa: BLE001 - fail every request, never hang them
            log.exception("engine thread failed")
            self._dead = err
            with self._lock:
                targets = list(self._targets.values())
                self._targets.clear()
            for target in targets:
                failure = EngineDeadError(_DEAD)
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    target.accepted.set_exception(failure)
                _send(target, failure)


def _send(target: _Target, item: RequestOutput | BaseException) -> bool:
    """Hand `item` to the request's loop; False when that loop has closed (its consumer is gone)."""
    try:
        target.loop.call_soon_threadsafe(target.outputs.put_nowait, item)
    except RuntimeError:  # "Event loop is closed": must not take the engine thread down
        return False
    return True


def create(config: ServeConfig) -> NativeBackend:
    """Build the engine the config describes and wrap it; the registry calls this."""
    from sage_infer.engine.build import build_engine

    return NativeBackend(build_engine(config), config.scheduler.max_waiting)
