"""The vLLM backend: vLLM's async engine (v1 `AsyncLLM`) behind sage's `InferenceBackend`.

`sage llm serve --backend vllm` keeps sage's front end (OpenAI routes, validation, chat
templates, errors, ``sage:*`` metrics); vLLM schedules, runs and samples. The front end
tokenizes once with sage's tokenizer and hands vLLM token ids, so both backends see the
same prompt. The config is translated by `vllm_args.vllm_engine_args`.

`AsyncLLM` belongs to the event loop it runs on (its output handler is a task there). It
gets a loop of its own, in one thread, so it serves any caller: the server's uvicorn loop,
or `asyncio.run` of the offline `LLM`. Requests cross into that loop with
`run_coroutine_threadsafe`; their outputs come back to the caller's loop the way the native
backend's do (`call_soon_threadsafe` into a per-request queue).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable

# vLLM logs to stdout unless told otherwise, and so does its engine-core process (which inherits
# this environment); sage's stdout carries results (`sage llm generate --json`), its logs stderr
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

from vllm import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.exceptions import GracefulHTTPError, VLLMClientError  # noqa: E402
from vllm.inputs.engine import tokens_input  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

from sage_infer.backends.streams import stream_outputs  # noqa: E402
from sage_infer.backends.vllm_args import VLLMModel, vllm_engine_args  # noqa: E402
from sage_infer.backends.vllm_request import VLLMRequest, sampling_params  # noqa: E402
from sage_infer.config.auto import ModelFacts  # noqa: E402
from sage_infer.config.serve import ServeConfig  # noqa: E402
from sage_infer.core.dtypes import DTYPE_NAMES  # noqa: E402
from sage_infer.core.messages import AddRequest, EngineStats, HealthStatus, KVTransferParams, ModelInfo  # noqa: E402
from sage_infer.core.outputs import RequestOutput  # noqa: E402
from sage_infer.errors import SageError  # noqa: E402
from sage_infer.interfaces.backend import (  # noqa: E402
    BackendError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
)

log = logging.getLogger("sage_infer.server")
auto_log = logging.getLogger("sage_infer.auto")  # the start-up lines `sage llm serve` prints

_DEAD = "the vLLM engine stopped after an internal error; restart the server"
MAX_HELD_ANSWERS = 4096  # prefill: connector answers kept until the server replies (normally at once)


class _SchedulerStats(StatLoggerBase):
    """vLLM's stat logger hook: keeps the latest scheduler snapshot and sums the prefix-cache
    counters (vLLM reports them per step), for `VLLMBackend.stats`."""

    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0  # requests looked up
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        self.num_running = scheduler_stats.num_running_reqs
        self.num_waiting = scheduler_stats.num_waiting_reqs
        self.kv_usage = scheduler_stats.kv_cache_usage
        cache = scheduler_stats.prefix_cache_stats
        self.prefix_queries += cache.requests
        self.prefix_query_tokens += cache.queries
        self.prefix_hit_tokens += cache.hits

    def log_engine_initialized(self) -> None:
        pass


class VLLMBackend:
    """`InferenceBackend` over vLLM's `AsyncLLM`, run on an event loop of its own."""

    name = "vllm"

    def __init__(self, engine_kwargs: dict, model_info: ModelInfo, pd_role: str | None = None) -> None:
        self._model_info = model_info
        # prefill | decode: vLLM's KV connector (SageKVConnector) moves the prompt's KV; see server/pd_handlers.py
        self.pd_role = pd_role
        self._held: collections.OrderedDict[str, dict] = collections.OrderedDict()  # prefill: answers by request
        self._stats = _SchedulerStats()
        self._requests: dict[str, VLLMRequest] = {}
        self._lock = threading.Lock()  # guards _requests between the caller's thread and the vLLM loop
        self._dead: BaseException | None = None
        self._on_finished: Callable[[RequestOutput], None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sage-vllm", daemon=True)
        self._thread.start()
        try:
            self.engine: AsyncLLM = self._run(self._build(engine_kwargs)).result()
        except Exception as err:  # noqa: BLE001 - vLLM logged the cause above; one line for the user
            self._stop_loop()
            raise SageError(f"vllm: the engine did not start: {str(err).splitlines()[0] if str(err) else err!r}",
                            hint="vLLM's log above says why") from err

    async def _build(self, engine_kwargs: dict) -> AsyncLLM:
        args = AsyncEngineArgs(**engine_kwargs, disable_log_stats=True)  # our logger only: no 10 s log lines
        return AsyncLLM.from_engine_args(args, stat_loggers=[lambda _config, _index=0: self._stats])

    def _run(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # -- InferenceBackend ---------------------------------------------------------------

    def start(self) -> None:
        """The engine started in the constructor (model_info needs it first); nothing left to do."""

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self._loop.is_closed() and self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._shutdown()).result(timeout)
        self._stop_loop()

    async def _shutdown(self) -> None:
        self.engine.shutdown()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def add_request(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        if self._dead is not None or self.engine.errored:
            raise EngineDeadError(_DEAD)
        params = sampling_params(request.params)
        if request.kv_transfer is not None:
            params.extra_args = {"kv_transfer_params": self._connector_params(request.kv_transfer)}
        state = VLLMRequest.of(request, asyncio.get_running_loop())
        with self._lock:
            if request.request_id in self._requests:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            self._requests[request.request_id] = state
        opening = self._run(self._open(state, params))
        try:  # shielded: cancelling a half-added request inside vLLM could orphan it there
            await asyncio.shield(asyncio.wrap_future(opening))
        except asyncio.CancelledError:
            self.abort(request.request_id)  # the caller left while vLLM took it: stop it once it is in
            raise
        return stream_outputs(state.outputs, lambda: self.abort(state.request.request_id))

    def abort(self, request_id: str) -> None:
        if not self._loop.is_closed():
            self._run(self._abort(request_id))

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        cache = self.engine.vllm_config.cache_config
        num_blocks = cache.num_gpu_blocks or 0
        busy = bool(self._requests)  # vLLM reports per step: idle, its last snapshot is stale
        usage = self._stats.kv_usage if busy else 0.0
        s = self._stats
        return EngineStats(
            num_running=s.num_running if busy else 0, num_waiting=s.num_waiting if busy else 0, kv_usage=usage,
            num_blocks=num_blocks, num_free_blocks=round(num_blocks * (1 - usage)), block_size=cache.block_size,
            prefix_caching=bool(cache.enable_prefix_caching), prefix_queries=s.prefix_queries,
            prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens)

    def health(self) -> HealthStatus:
        if self._dead is not None or self.engine.errored:
            return HealthStatus(False, _DEAD)
        return HealthStatus(True)

    def on_finished(self, callback: Callable[[RequestOutput], None]) -> None:
        self._on_finished = callback

    def _connector_params(self, transfer: KVTransferParams) -> dict:
        """sage's transfer of a request as SageKVConnector's ``kv_transfer_params``."""
        if self.pd_role is None:
            raise InvalidRequestError("kv_transfer_params: this instance has no prefill/decode role")
        if transfer.hold:
            return {"do_remote_decode": True}
        if transfer.connector is None:
            raise InvalidRequestError("kv_transfer_params: a vLLM decode instance pulls KV a vLLM prefill instance "
                                      "held (its answer's sage_pd), not a native one's")
        return dict(transfer.connector)

    def held_params(self, request_id: str) -> dict | None:
        """Prefill: the ``kv_transfer_params`` a finished held request answered (once)."""
        with self._lock:
            return self._held.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (tests wait for 0)."""
        return len(self._requests)

    # -- the caller's loop ----------------------------------------------------------------

    # -- the vLLM loop --------------------------------------------------------------------

    async def _open(self, state: VLLMRequest, params: VLLMSamplingParams) -> None:
        try:
            await self._add(state, params)
        except BaseException:
            with self._lock:
                self._requests.pop(state.request.request_id, None)
            raise
        if state.abort_asked:
            await self.engine.abort(state.request.request_id)

    async def _add(self, state: VLLMRequest, params: VLLMSamplingParams) -> None:
        request = state.request
        prompt = tokens_input(list(request.prompt_token_ids), prompt=request.prompt, cache_salt=request.cache_salt)
        try:
            # sage ignores priority under fifo scheduling; vLLM refuses a non-zero one under fcfs
            priority = request.priority if self.engine.scheduler_config.policy == "priority" else 0
            collector = await self.engine.add_request(request.request_id, prompt, params, priority=priority)
        except VLLMEngineDeadError:
            raise EngineDeadError(_DEAD) from None
        except GracefulHTTPError as err:  # vLLM's queue limits (max_num_queued_reqs)
            raise QueueFullError(str(err) or "vLLM's request queue is full") from None
        except (VLLMClientError, ValueError, TypeError) as err:  # vLLM's validation: the request's fault
            raise InvalidRequestError(str(err)) from None
        state.opened = True
        state.pump = asyncio.create_task(self._pump(state, collector))

    async def _abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is None or state.finished:
            return
        if not state.opened:
            state.abort_asked = True  # `_open` is awaiting vLLM; it aborts once vLLM has the request
            return
        await self.engine.abort(request_id)  # vLLM hands the collector a final output, finish_reason abort

    async def _pump(self, state: VLLMRequest, collector) -> None:
        try:
            while not state.finished:
                out = collector.get_nowait() or await collector.get()
                self._deliver(state, state.output(out))
        except VLLMEngineDeadError as err:
            self._dead = err
            self._fail(state, EngineDeadError(_DEAD))
        except Exception as err:  # noqa: BLE001 - end the stream, never leave it hanging
            log.exception("vLLM request %s failed", state.request.request_id)
            self._fail(state, BackendError(f"generation failed: {type(err).__name__}"))
        finally:
            collector.close()

    def _deliver(self, state: VLLMRequest, output: RequestOutput) -> None:
        if output.finished:
            with self._lock:
                self._requests.pop(output.request_id, None)
                transfer = state.request.kv_transfer
                if transfer is not None and transfer.hold:  # what the decode instance needs to pull the KV
                    self._held[output.request_id] = state.kv_transfer_params or {"do_remote_prefill": False}
                    while len(self._held) > MAX_HELD_ANSWERS:
                        self._held.popitem(last=False)
            if self._on_finished is not None:
                self._on_finished(output)
        if not _send(state, output) and not output.finished:
            self._loop.create_task(self._abort(output.request_id))  # nobody is left to read it

    def _fail(self, state: VLLMRequest, error: BaseException) -> None:
        state.finished = True
        with self._lock:
            self._requests.pop(state.request.request_id, None)
        _send(state, error)


def _send(state: VLLMRequest, item: RequestOutput | BaseException) -> bool:
    """Hand `item` to the request's loop; False when that loop has closed (its consumer is gone)."""
    try:
        state.loop.call_soon_threadsafe(state.outputs.put_nowait, item)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def create(config: ServeConfig) -> VLLMBackend:
    """Translate `config`, print each decision, start vLLM; the registry calls this."""
    from sage_infer.engine.build import DEMO_MODEL_NAME
    from sage_infer.hal.cpu import read_mem_available
    from sage_infer.hal.net import free_port
    from sage_infer.models.loader import ModelLoadError, arch_config, resolve_model_dir
    from sage_infer.models.tokenizer import Tokenizer

    directory = resolve_model_dir(config.model.path)
    arch = arch_config(directory)
    facts = ModelFacts(DTYPE_NAMES.get(arch.torch_dtype, "fp32"),
                       arch.max_position_embeddings, arch.sliding_window)
    name = config.model.served_name or (DEMO_MODEL_NAME if config.model.path is None else directory.name)
    model = VLLMModel(str(directory), name, facts, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    args = vllm_engine_args(config, model, current_platform.device_type, read_mem_available(),
                            pd_port=free_port() if config.role == "prefill" else None)
    for value in args.values:
        auto_log.info("%s", value.line())
    try:
        tokenizer = Tokenizer.from_dir(directory)
    except (FileNotFoundError, ValueError) as err:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {err}") from None
    info = ModelInfo(name=name, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                     vocab_size=arch.vocab_size, max_model_len=args.max_model_len,
                     max_bytes_per_token=tokenizer.max_bytes_per_token)
    return VLLMBackend(args.kwargs, info, config.role if config.role != "both" else None)
