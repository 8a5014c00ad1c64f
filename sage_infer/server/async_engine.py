"""Runs the `LLMEngine` in its own thread so HTTP requests stream while others are scheduled.

The HTTP side never touches engine state: it sends commands (add, abort) through a
queue; the engine thread applies them between steps and hands each request's outputs
back to that request's asyncio queue on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine.llm_engine import LLMEngine
from sage_infer.engine.outputs import RequestOutput

log = logging.getLogger("sage_infer.server")


class QueueFullError(RuntimeError):
    """More requests are waiting than the scheduler's `max_waiting` allows."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the server cannot serve."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    done: concurrent.futures.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sage-engine", daemon=True)
        self.dead: BaseException | None = None
        # called on the engine thread for every finished request, aborted ones included
        self.on_finished: Callable[[RequestOutput], None] | None = None

    # -- called from the event loop -----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._pending_adds

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def add(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
        priority: int = 0, cache_salt: str | None = None,
    ) -> asyncio.Queue:
        """Queue a request; raises `RequestError` (bad request) or `QueueFullError`."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        with self._lock:
            if self.num_waiting >= self.max_waiting:
                raise QueueFullError(f"{self.num_waiting} requests are waiting (max {self.max_waiting})")
            self._pending_adds += 1
        stream: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        loop = asyncio.get_running_loop()
        self._commands.put(_Add(request_id, prompt, params, priority, cache_salt, stream, loop, done))
        self._wake.set()
        await asyncio.wrap_future(done)
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
        priority: int = 0, cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; aborts it if the consumer stops early."""
        stream = await self.add(request_id, prompt, params, priority=priority, cache_salt=cache_salt)
        async for output in self.outputs(request_id, stream):
            yield output

    async def outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Drain a request added with `add`; aborts it if the consumer stops before it finished."""
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params,
                                            priority=command.priority, cache_salt=command.cache_salt)
                    self._streams[command.request_id] = (command.loop, command.stream)
                    command.done.set_result(None)
                except Exception as err:  # noqa: BLE001 - handed back to the request that caused it
                    command.done.set_exception(err)
                finally:
                    with self._lock:
                        self._pending_adds -= 1
            else:
                _, request_id = command
                if request_id in self._streams:
                    self.engine.abort_request(request_id)
                    self._deliver(self.engine.drain_finished())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is None:
                continue
            loop, stream = target
            if output.finished:
                del self._streams[output.request_id]
                if self.on_finished is not None:
                    self.on_finished(output)
            loop.call_soon_threadsafe(stream.put_nowait, output)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as err:  # noqa: BLE001 - fail every request, never hang them
            log.exception("engine thread failed")
            self.dead = err
            failure = EngineDeadError(f"internal engine error: {type(err).__name__}")
            for loop, stream in self._streams.values():
                loop.call_soon_threadsafe(stream.put_nowait, failure)
            self._streams.clear()
