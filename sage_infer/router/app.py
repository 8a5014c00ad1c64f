"""The prefill/decode router: one OpenAI-compatible endpoint in front of prefill and decode workers.

Each generation request goes first to a prefill worker with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}`` (it computes the prompt and holds its KV),
then to a decode worker with the original body plus ``kv_transfer_params`` naming the held KV;
the decode worker pulls the blocks and generates, and its answer (a JSON body or an SSE
stream) goes back to the client unchanged. Requests P/D cannot split (several prompts in one
completions call) and requests arriving while no prefill worker is up go to a decode worker
whole: it computes their prompts itself.

The prefill worker is chosen as a fleet router chooses a replica (`router.fleet`, policy
`--routing`, kv by default): the prefill workers push their KV events (every tier) into one index,
and the router sends each prompt where its estimated time to first token is lowest — the prefix a
worker holds (and where) against the work queued there; the prediction is checked against the
cached tokens the prefill worker reports. Decode workers are chosen by least outstanding requests (and, under strategy
slo, measured TPOT). A worker that fails a call is skipped for a few seconds. Errors are
OpenAI-style JSON: a worker's own 4xx passes through; a decode worker found unreachable before it
answered is replaced by another one that is up (the request is retried there), else it is a 503.

The parts: `PDRouter` takes a request through admission, its prefill worker and its decode
worker; `_DecodeRelay` carries one streamed answer to the client; `build_router` is their HTTP face.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from sage_infer.config.serve import RouterConfig
from sage_infer.kv_policy.routing import Request as RouteRequest
from sage_infer.kv_policy.routing import Route
from sage_infer.router.admission import Admission, Slo
from sage_infer.router.fleet import FleetRouter
from sage_infer.router.http import (
    CALL_TIMEOUT,
    asking_for_usage,
    chained,
    completion_tokens,
    encode,
    passthrough,
    read_body,
    router_app,
    several_prompts,
    stream_error,
    up_to_first_token,
    usage_event,
    usage_of,
    worker_headers,
)
from sage_infer.router.instances import Instance, Instances
from sage_infer.router.local_prompts import LocalPrompts
from sage_infer.router.metrics import FleetMetrics
from sage_infer.router.responses import ResponsesRouting
from sage_infer.server.body import validate_body
from sage_infer.server.openai_errors import APIError, check_bearer
from sage_infer.server.pd_auth import sign_pull
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest

ROUTER_FIELDS = ("slo_ttft_ms", "slo_tpot_ms")  # read by the router, not sent to workers


@dataclass(slots=True)
class Prefill:
    """A prefill worker chosen for a request and, when the fleet's policy chose it, what it predicted there."""

    worker: Instance
    route: Route | None = None
    described: RouteRequest | None = None
    sent: float = field(default_factory=time.monotonic)

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """The request's prompt tokens queued at the worker (as the policy sees it) while it computes them."""
        if self.route is None:
            yield
            return
        self.route.replica.take(self.route.compute_tokens, self.route.blocks)
        try:
            yield
        finally:
            self.route.replica.release(self.route.compute_tokens, blocks=self.route.blocks)

    def check(self, fleet: FleetRouter | None, usage: dict) -> None:
        """The prefill worker answered: its cached tokens check the prediction, its time refines the rates."""
        if fleet is not None and self.route is not None:
            fleet.check_prediction(self.route, self.described, usage)
            fleet.first_token(self.route, time.monotonic() - self.sent)


class PDRouter:
    """Routes OpenAI requests over prefill and decode `instances`; `api_key` is required from clients and sent
    to workers; `config` sets admission (how many requests run at the decode workers, who goes next)."""

    def __init__(self, instances: Instances, api_key: str | None = None, config: RouterConfig | None = None,
                 routing: str = "kv", prompts: LocalPrompts | None = None) -> None:
        self.instances, self.api_key = instances, api_key
        self.metrics = FleetMetrics()
        self.admission = Admission(config or RouterConfig(), len(instances.decode))
        self.metrics.waiting.set_function(lambda: len(self.admission.waiting))
        self.headers = worker_headers(api_key)
        self.client = httpx.AsyncClient(timeout=CALL_TIMEOUT)
        # the prefill workers as a fleet (only worth it when there is a choice between them)
        prefill = [w.url for w in instances.prefill]
        self.prefill_fleet = FleetRouter(prefill, routing, api_key, prompts=prompts, metrics=self.metrics) \
            if len(prefill) > 1 else None
        # a Responses request runs whole on a decode worker, which keeps the conversation (router.responses)
        decode = {w.url: w for w in instances.decode}
        self.responses = ResponsesRouting(
            lambda: self.client, self.headers,
            lambda: [w.url for w in sorted(instances.decode, key=lambda w: w.outstanding) if w.up],
            self.choose_decode, self.hold, lambda url, why: self.failed(decode[url], why))

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.prefill_fleet is not None:
            await self.prefill_fleet.start()

    async def stop(self) -> None:
        if self.prefill_fleet is not None:
            await self.prefill_fleet.stop()
        await self.client.aclose()

    def authorize(self, request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), self.api_key)

    # -- admission -------------------------------------------------------------------------------

    async def handle(self, path: str, request: Request) -> Response:
        """A client's completions or chat request, answered by a decode worker (after a prefill worker)."""
        self.authorize(request)
        body = await read_body(request)
        splittable = path != "/v1/completions" or not several_prompts(body)
        return await self.route(path, body, splittable, request.headers)

    async def route(self, path: str, body: dict, splittable: bool, headers: Mapping[str, str]) -> Response:
        """Admit the request (it may wait for a decode worker slot), then dispatch it; it leaves admission when its
        answer is complete (a stream: when its relay ends)."""
        # the workers' own checks first: a body the decode worker would refuse must not get as far as a prefill
        # worker, which would hold its KV for a pull that never comes
        schema = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
        validate_body({k: v for k, v in body.items() if k not in ROUTER_FIELDS}, schema)
        if self.instances.pick("decode") is None:  # before any prefill work that nobody could continue
            raise APIError(503, "no decode worker is up")
        slo = self.admission.slo(body, time.monotonic())
        await self.admission.enter(body, slo.arrival)
        try:
            response = await self.dispatch(path, body, splittable, slo, headers)
        except BaseException:
            self.admission.leave()
            raise
        if isinstance(response, StreamingResponse):
            return response  # its relay leaves when the stream ends
        self.admission.leave()
        return response

    # -- prefill ---------------------------------------------------------------------------------

    async def choose_prefill(self, body: dict, tried: set[str], headers: Mapping[str, str]) -> Prefill | None:
        """The prefill worker the fleet's policy picks among those up and not tried (the least loaded while no
        worker's events have come in yet); None when none is left."""
        live = [w for w in self.instances.prefill if w.up and w.url not in tried]
        if len(live) <= 1 or self.prefill_fleet is None:
            return Prefill(live[0]) if live else None
        fleet = self.prefill_fleet
        described = await fleet.describe(body, headers)
        route = fleet.policy.route(described, exclude={w.url for w in self.instances.prefill} - {w.url for w in live})
        if route is None:
            return Prefill(min(live, key=lambda w: w.outstanding))
        if route.moved:
            self.metrics.moved.inc()
        return Prefill(next(w for w in live if w.url == route.replica.name), route, described)

    async def prefill(self, path: str, body: dict, headers: Mapping[str, str]) -> dict | None:
        """Run the prompt on a prefill worker, holding its KV: the decode worker's kv_transfer_params, or
        None when no prefill worker could (the decode worker then computes the prompt itself)."""
        tried: set[str] = set()
        while (chosen := await self.choose_prefill(body, tried, headers)) is not None:
            worker = chosen.worker
            tried.add(worker.url)
            first = {**body, "stream": False, "n": 1, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}
            first.pop("stream_options", None)
            first.pop("max_completion_tokens", None)
            with self.track(worker), chosen.queued():
                try:
                    reply = await self.call(worker, path, first)
                except APIError:
                    continue  # down: try the next prefill worker
            if reply.status_code >= 500:
                self.failed(worker, f"HTTP {reply.status_code}")
                continue
            if reply.status_code != 200:
                raise passthrough(reply)  # the request itself is wrong: the decode worker would say the same
            chosen.check(self.prefill_fleet, usage_of(reply))
            return self.pull_params(worker, reply.json().get("kv_transfer_params") or {})
        return None

    def pull_params(self, worker: Instance, held: dict) -> dict:
        """What tells the decode worker where to pull the KV `worker` holds (signed when the router has a key)."""
        params = {"remote_url": worker.url, **held}
        if self.api_key and "remote_request_id" in held:  # the decode worker pulls only what its router signed
            params["signature"] = sign_pull(self.api_key, worker.url, held["remote_request_id"])
        return params

    # -- decode ----------------------------------------------------------------------------------

    async def choose_decode(self, body: dict, request: Request, exclude: set[str]) -> str | None:
        worker = self.instances.pick("decode", exclude=exclude)
        return worker.url if worker is not None else None

    def hold(self, url: str):
        """Count a request in flight at the decode worker `url` until the returned function is called."""
        worker = next(w for w in self.instances.decode if w.url == url)
        self.enter(worker)
        return lambda: self.leave(worker)

    async def dispatch(self, path: str, body: dict, splittable: bool, slo: Slo,
                       headers: Mapping[str, str]) -> Response:
        forwarded = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
        params = await self.prefill(path, forwarded, headers) if splittable else None
        if params is None:
            self.metrics.colocated.inc()
        second = {**forwarded, "kv_transfer_params": params} if params else forwarded
        tried: set[str] = set()
        while True:  # a decode worker found unreachable before it answered: the next one, if any is up
            worker = self.instances.pick("decode", exclude=tried, tpot_target=slo.tpot_s)
            if worker is None:
                raise APIError(503, "no decode worker is up")
            tried.add(worker.url)
            try:
                if body.get("stream"):
                    return await self.stream(worker, path, second, slo)
                return await self.decode(worker, path, second, slo)
            except APIError as err:
                if err.status != 503 or self.instances.pick("decode", exclude=tried) is None:
                    raise
                self.metrics.retries.inc()

    async def decode(self, worker: Instance, path: str, body: dict, slo: Slo) -> Response:
        """A non-streamed answer from `worker`; its time per output token feeds the worker's TPOT."""
        started = time.monotonic()
        with self.track(worker):
            reply = await self.call(worker, path, body)
        if reply.status_code >= 500:
            worker.failed(f"HTTP {reply.status_code}")
        elif reply.status_code == 200:
            tokens = completion_tokens(usage_of(reply))
            if tokens > 1:  # an upper bound: the call's time includes the KV pull and the first token
                self.observe_tpot(worker, slo, (time.monotonic() - started) / tokens)
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    async def stream(self, worker: Instance, path: str, body: dict, slo: Slo) -> Response:
        """Relay the decode worker's SSE stream; its status line and errors come through as sent."""
        body, wants_usage = asking_for_usage(body)  # its token count measures TPOT (a bad value: the worker's 400)
        self.enter(worker)
        try:
            request = self.client.build_request("POST", f"{worker.url}{path}", content=encode(body),
                                                headers=self.headers)
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as err:
            self.leave(worker)
            self.failed(worker, str(err) or type(err).__name__)
            raise APIError(503, f"decode worker {worker.url} is unreachable") from None
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self.leave(worker)
            return Response(content, status_code=upstream.status_code, media_type="application/json")  # (leaves)
        try:  # nothing goes to the client before the first token: a worker that dies before it loses no request
            head, rest = await up_to_first_token(upstream)
        except (httpx.HTTPError, StopAsyncIteration) as err:
            await upstream.aclose()
            self.leave(worker)
            self.failed(worker, f"its stream ended before its first token ({err or type(err).__name__})")
            raise APIError(503, f"decode worker {worker.url} stopped before its first token") from None
        relay = _DecodeRelay(self, worker, upstream, slo, wants_usage)
        return StreamingResponse(relay.events(head, rest), media_type="text/event-stream",
                                 background=BackgroundTask(relay.finish))

    # -- calls and bookkeeping -------------------------------------------------------------------

    async def call(self, worker: Instance, path: str, body: dict) -> httpx.Response:
        """One non-streaming call; an unreachable worker is marked down and raises APIError(503)."""
        try:
            return await self.client.post(f"{worker.url}{path}", content=encode(body), headers=self.headers)
        except httpx.HTTPError as err:
            self.failed(worker, str(err) or type(err).__name__)
            raise APIError(503, f"{worker.role} worker {worker.url} is unreachable") from None

    def failed(self, worker: Instance, why: str) -> None:
        """A call to `worker` failed: skipped for a while, and counted."""
        worker.failed(why)
        self.metrics.failures.labels(worker.url, worker.role).inc()

    def enter(self, worker: Instance) -> None:
        """Count a request as outstanding at `worker`."""
        worker.outstanding += 1
        worker.routed += 1
        self.metrics.routed.labels(worker.url, worker.role).inc()
        self.metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)

    def leave(self, worker: Instance) -> None:
        worker.outstanding -= 1
        self.metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)

    @contextlib.contextmanager
    def track(self, worker: Instance) -> Iterator[None]:
        """Count a request as outstanding at a worker while it runs there."""
        self.enter(worker)
        try:
            yield
        finally:
            self.leave(worker)

    def observe_tpot(self, worker: Instance, slo: Slo, seconds: float) -> None:
        worker.observe_tpot(seconds)
        self.metrics.tpot.labels(worker.url).set(worker.tpot_s)
        if slo.tpot_s is not None:
            self.metrics.slo.labels("tpot", str(seconds <= slo.tpot_s).lower()).inc()

    # -- other routes ----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        worker = self.instances.pick("decode")
        if worker is None:
            raise APIError(503, "no decode worker is up")
        try:
            reply = await self.client.get(f"{worker.url}/v1/models", headers=self.headers)
        except httpx.HTTPError:
            worker.failed("unreachable")
            raise APIError(503, f"decode worker {worker.url} is unreachable") from None
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    async def health(self, request: Request) -> JSONResponse:
        """Up, degraded (some worker down) or down (no decode worker up). Each worker's URL, role and state
        only for a caller with the key (when one is set): the addresses behind the router are not public."""
        results = await asyncio.gather(*(self.probe(w) for w in self.instances.all()))
        try:
            self.authorize(request)
            status = {w.url: {"role": w.role, "up": ok} for w, ok in results}
        except APIError:  # counts per role, no addresses
            status = {role: {"up": sum(ok for w, ok in results if w.role == role),
                             "total": sum(w.role == role for w, _ in results)} for role in ("prefill", "decode")}
        for worker, ok in results:
            if not ok:
                worker.failed("health check failed")
        if not any(ok for w, ok in results if w.role == "decode"):
            return JSONResponse({"status": "down", "workers": status}, status_code=503)
        degraded = not all(ok for _, ok in results)
        return JSONResponse({"status": "degraded" if degraded else "ok", "workers": status})

    async def probe(self, worker: Instance) -> tuple[Instance, bool]:
        try:
            reply = await self.client.get(f"{worker.url}/health", timeout=2.0)
            return worker, reply.status_code == 200
        except httpx.HTTPError:
            return worker, False


class _DecodeRelay:
    """One streamed answer on its way from a decode worker to the client, from its first token (TTFT under strategy
    slo): the usage event's token count measures TPOT, and the request leaves the worker and admission once,
    however the stream ends."""

    def __init__(self, router: PDRouter, worker: Instance, upstream: httpx.Response, slo: Slo,
                 wants_usage: bool) -> None:
        self.router, self.worker, self.upstream, self.slo, self.wants_usage = router, worker, upstream, slo, wants_usage
        self.done = False

    async def events(self, head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Relay `head` (the stream up to its first token, read before the client was answered), then `rest`."""
        router, worker, slo = self.router, self.worker, self.slo
        pending = b""  # the part of an event not yet complete
        first = time.monotonic()  # the client's first token
        if slo.ttft_s is not None:
            router.metrics.slo.labels("ttft", str(first - slo.arrival <= slo.ttft_s).lower()).inc()
        tokens = 0  # completion tokens, from the usage event the router asked the worker for
        try:
            async for chunk in chained(head, rest):
                *events, pending = (pending + chunk).split(b"\n\n")
                relayed = []
                for event in events:
                    usage = usage_event(event)
                    if usage is not None:
                        tokens = completion_tokens(usage)
                        if not self.wants_usage:
                            continue  # asked for by the router alone: the client never sees it
                    relayed.append(event + b"\n\n")
                if relayed:
                    yield b"".join(relayed)
            if tokens > 1:  # seconds per output token after the first, as TPOT is defined
                router.observe_tpot(worker, slo, (time.monotonic() - first) / (tokens - 1))
        except httpx.HTTPError as err:  # the worker died mid-stream: end the stream with an error event
            router.failed(worker, str(err) or type(err).__name__)
            yield stream_error(f"decode worker {worker.url} stopped during the request")  # a half-sent event is dropped
        finally:
            await self.finish()

    async def finish(self) -> None:
        """Once, however the stream ends (finished, worker gone, client gone before the first byte)."""
        if self.done:
            return
        self.done = True
        await self.upstream.aclose()
        self.router.leave(self.worker)
        self.router.admission.leave()


def build_router(instances: Instances, api_key: str | None = None, config: RouterConfig | None = None,
                 routing: str = "kv", prompts: LocalPrompts | None = None) -> FastAPI:
    """The router app over `instances`; `api_key` is required from clients and sent to workers; `routing` chooses
    among the prefill workers, `prompts` tokenizes prompts here for it (`router.local_prompts`)."""
    router = PDRouter(instances, api_key, config, routing, prompts)
    app = router_app("sage_infer router", router)
    app.state.instances, app.state.metrics = instances, router.metrics

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        return await router.health(request)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
