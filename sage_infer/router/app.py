"""The prefill/decode router: one OpenAI-compatible endpoint in front of prefill and decode workers.

Each generation request goes first to a prefill worker with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}`` (it computes the prompt and holds its KV),
then to a decode worker with the original body plus ``kv_transfer_params`` naming the held KV;
the decode worker pulls the blocks and generates, and its answer (a JSON body or an SSE
stream) goes back to the client unchanged. Requests P/D cannot split (several prompts in one
completions call) and requests arriving while no prefill worker is up go to a decode worker
whole: it computes their prompts itself.

The prefill worker is chosen by prefix overlap: with more than one up, the router asks each
(``POST /v1/kv/match``, side-effect free) how many of the prompt's tokens it holds cached, and
sends the request to the one holding most, unless it is much busier than the least loaded one
(then load wins). Decode workers are chosen by least outstanding requests (and, under strategy
slo, measured TPOT). A worker that fails a call is skipped for a few seconds. Errors are
OpenAI-style JSON: a worker's own 4xx passes through; a decode worker found unreachable before it
answered is replaced by another one that is up (the request is retried there), else it is a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from sage_infer.config.serve import RouterConfig
from sage_infer.router.admission import Admission, Slo
from sage_infer.router.http import (
    CALL_TIMEOUT,
    MATCH_FIELDS,
    completion_tokens,
    encode,
    passthrough,
    read_body,
    router_app,
    several_prompts,
    usage_event,
    usage_of,
)
from sage_infer.router.instances import Instance, Instances
from sage_infer.router.metrics import RouterMetrics
from sage_infer.server.body import validate_body
from sage_infer.server.errors import APIError, check_bearer, error_body
from sage_infer.server.pd_auth import sign_pull
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest

MATCH_TIMEOUT_S = 0.5  # a worker's answer to "what are this prompt's block hashes?"
EVENTS_POLL_S = 0.1  # how often the router asks each prefill worker what its prefix cache stored and removed
EVENTS_TIMEOUT_S = 2.0
BALANCE_SLACK = 4  # the best-overlap worker is skipped when it has this many more requests than the least loaded
ROUTER_FIELDS = ("slo_ttft_ms", "slo_tpot_ms")  # read by the router, not sent to workers


def build_router(instances: Instances, api_key: str | None = None, config: RouterConfig | None = None) -> FastAPI:
    """The router app over `instances`; `api_key` is required from clients and sent to workers."""
    app = router_app("sage_infer router")
    metrics = RouterMetrics()
    admission = Admission(config or RouterConfig(), len(instances.decode))
    metrics.waiting.set_function(lambda: len(admission.waiting))
    worker_headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key
                                                             else {})}
    app.state.instances, app.state.metrics = instances, metrics
    client = httpx.AsyncClient(timeout=CALL_TIMEOUT)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        follower = asyncio.create_task(follow_events()) if len(instances.prefill) > 1 else None
        yield
        if follower is not None:
            follower.cancel()
        await client.aclose()

    app.router.lifespan_context = lifespan

    def authorize(request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), api_key)

    async def call(worker: Instance, path: str, body: dict) -> httpx.Response:
        """One non-streaming call; an unreachable worker is marked down and raises APIError(503)."""
        try:
            return await client.post(f"{worker.url}{path}", content=encode(body), headers=worker_headers)
        except httpx.HTTPError as err:
            worker.failed(str(err) or type(err).__name__)
            metrics.failures.labels(worker.url, worker.role).inc()
            raise APIError(503, f"{worker.role} worker {worker.url} is unreachable") from None

    async def follow_events() -> None:
        """Keep each prefill worker's view of its cached blocks current from its /v1/kv/events."""
        while True:
            for worker in instances.prefill:
                if not worker.up:
                    continue
                try:
                    reply = await client.get(f"{worker.url}/v1/kv/events", params={"since": worker.events_next},
                                             headers=worker_headers, timeout=EVENTS_TIMEOUT_S)
                    if reply.status_code == 200:
                        worker.apply(reply.json())
                        metrics.cached_blocks.labels(worker.url).set(len(worker.cached))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass  # a worker that is down is found by the calls that need it; its view waits
            await asyncio.sleep(EVENTS_POLL_S)

    async def prompt_hashes(worker: Instance, body: dict) -> dict | None:
        question = {k: body[k] for k in MATCH_FIELDS if k in body}
        try:
            reply = await client.post(f"{worker.url}/v1/kv/hashes", content=encode(question), headers=worker_headers,
                                      timeout=MATCH_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None

    async def choose_prefill(body: dict, tried: set[str]) -> Instance | None:
        """The prefill worker whose cache (as its events tell) holds the longest prefix of this prompt, unless
        it is busier than the least loaded one by more than `BALANCE_SLACK` requests; else the least loaded."""
        live = [w for w in instances.prefill if w.up and w.url not in tried]
        if len(live) <= 1:
            return live[0] if live else None
        least = min(live, key=lambda w: w.outstanding)
        prompt = await prompt_hashes(least, body)  # any worker hashes a prompt the same way
        if prompt is None:
            return least
        hashes = prompt["hashes"]
        best = max(live, key=lambda w: (w.overlap(hashes), -w.outstanding))
        blocks = best.overlap(hashes)
        chosen = best if blocks and best.outstanding <= least.outstanding + BALANCE_SLACK else least
        metrics.prompt_tokens.inc(prompt["prompt_tokens"])
        metrics.overlap_tokens.inc(chosen.overlap(hashes) * prompt["tokens_per_hash"])
        return chosen

    async def prefill(path: str, body: dict) -> dict | None:
        """Run the prompt on a prefill worker, holding its KV: the decode worker's kv_transfer_params, or
        None when no prefill worker could (the decode worker then computes the prompt itself)."""
        tried: set[str] = set()
        while (worker := await choose_prefill(body, tried)) is not None:
            tried.add(worker.url)
            first = {**body, "stream": False, "n": 1, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}
            first.pop("stream_options", None)
            first.pop("max_completion_tokens", None)
            with track(worker):
                try:
                    reply = await call(worker, path, first)
                except APIError:
                    continue  # down: try the next prefill worker
            if reply.status_code >= 500:
                worker.failed(f"HTTP {reply.status_code}")
                metrics.failures.labels(worker.url, worker.role).inc()
                continue
            if reply.status_code != 200:
                raise passthrough(reply)  # the request itself is wrong: the decode worker would say the same
            held = reply.json().get("kv_transfer_params") or {}
            params = {"remote_url": worker.url, **held}
            if api_key and "remote_request_id" in held:  # the decode worker pulls only what its router signed
                params["signature"] = sign_pull(api_key, worker.url, held["remote_request_id"])
            return params
        return None

    @contextlib.contextmanager
    def track(worker: Instance):
        """Count a request as outstanding at a worker while it runs there."""
        worker.outstanding += 1
        worker.routed += 1
        metrics.routed.labels(worker.url, worker.role).inc()
        metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)
        try:
            yield
        finally:
            worker.outstanding -= 1
            metrics.outstanding.labels(worker.url, worker.role).set(worker.outstanding)

    async def route(path: str, body: dict, splittable: bool) -> Response:
        # the workers' own checks first: a body the decode worker would refuse must not get as far as a prefill
        # worker, which would hold its KV for a pull that never comes
        schema = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
        validate_body({k: v for k, v in body.items() if k not in ROUTER_FIELDS}, schema)
        if instances.pick("decode") is None:  # before any prefill work that nobody could continue
            raise APIError(503, "no decode worker is up")
        slo = admission.slo(body, time.monotonic())
        await admission.enter(body, slo.arrival)
        try:
            response = await dispatch(path, body, splittable, slo)
        except BaseException:
            admission.leave()
            raise
        if isinstance(response, StreamingResponse):
            return response  # its relay leaves when the stream ends
        admission.leave()
        return response

    async def dispatch(path: str, body: dict, splittable: bool, slo: Slo) -> Response:
        forwarded = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
        params = await prefill(path, forwarded) if splittable else None
        if params is None:
            metrics.colocated.inc()
        second = {**forwarded, "kv_transfer_params": params} if params else forwarded
        tried: set[str] = set()
        while True:  # a decode worker found unreachable before it answered: the next one, if any is up
            worker = instances.pick("decode", exclude=tried, tpot_target=slo.tpot_s)
            if worker is None:
                raise APIError(503, "no decode worker is up")
            tried.add(worker.url)
            try:
                if body.get("stream"):
                    return await stream(worker, path, second, slo)
                started = time.monotonic()
                with track(worker):
                    reply = await call(worker, path, second)
                break
            except APIError as err:
                if err.status != 503 or instances.pick("decode", exclude=tried) is None:
                    raise
                metrics.retries.inc()
        if reply.status_code >= 500:
            worker.failed(f"HTTP {reply.status_code}")
        elif reply.status_code == 200:
            tokens = completion_tokens(usage_of(reply))
            if tokens > 1:  # an upper bound: the call's time includes the KV pull and the first token
                observe_tpot(worker, slo, (time.monotonic() - started) / tokens)
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    def observe_tpot(worker: Instance, slo: Slo, seconds: float) -> None:
        worker.observe_tpot(seconds)
        metrics.tpot.labels(worker.url).set(worker.tpot_s)
        if slo.tpot_s is not None:
            metrics.slo.labels("tpot", str(seconds <= slo.tpot_s).lower()).inc()

    async def stream(worker: Instance, path: str, body: dict, slo: Slo) -> Response:
        """Relay the decode worker's SSE stream; its status line and errors come through as sent."""
        options = body.get("stream_options") or {}
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        if isinstance(options, dict):  # the usage event's token count measures TPOT (a bad value: the worker's 400)
            body = {**body, "stream_options": {**options, "include_usage": True}}
        tracking = track(worker)
        tracking.__enter__()
        try:
            request = client.build_request("POST", f"{worker.url}{path}", content=encode(body), headers=worker_headers)
            upstream = await client.send(request, stream=True)
        except httpx.HTTPError as err:
            tracking.__exit__(None, None, None)
            worker.failed(str(err) or type(err).__name__)
            metrics.failures.labels(worker.url, worker.role).inc()
            raise APIError(503, f"decode worker {worker.url} is unreachable") from None
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            tracking.__exit__(None, None, None)
            return Response(content, status_code=upstream.status_code, media_type="application/json")  # (leaves)

        done = False

        async def finish() -> None:
            """Once, however the stream ends (finished, worker gone, client gone before the first byte)."""
            nonlocal done
            if done:
                return
            done = True
            await upstream.aclose()
            tracking.__exit__(None, None, None)
            admission.leave()

        async def relay() -> AsyncIterator[bytes]:
            pending = b""  # the part of an event not yet complete
            first = 0.0  # when the first event came: the client's first token
            tokens = 0  # completion tokens, from the usage event the router asked the worker for
            try:
                async for chunk in upstream.aiter_raw():
                    if not first:
                        first = time.monotonic()
                        if slo.ttft_s is not None:
                            metrics.slo.labels("ttft", str(first - slo.arrival <= slo.ttft_s).lower()).inc()
                    *events, pending = (pending + chunk).split(b"\n\n")
                    relayed = []
                    for event in events:
                        usage = usage_event(event)
                        if usage is not None:
                            tokens = completion_tokens(usage)
                            if not wants_usage:
                                continue  # asked for by the router alone: the client never sees it
                        relayed.append(event + b"\n\n")
                    if relayed:
                        yield b"".join(relayed)
                if tokens > 1:  # seconds per output token after the first, as TPOT is defined
                    observe_tpot(worker, slo, (time.monotonic() - first) / (tokens - 1))
            except httpx.HTTPError as err:  # the worker died mid-stream: end the stream with an error event
                worker.failed(str(err) or type(err).__name__)
                metrics.failures.labels(worker.url, worker.role).inc()
                message = f"decode worker {worker.url} stopped during the request"  # a half-sent event is dropped
                yield f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n".encode()
            finally:
                await finish()

        return StreamingResponse(relay(), media_type="text/event-stream", background=BackgroundTask(finish))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await read_body(request)
        return await route("/v1/completions", body, splittable=not several_prompts(body))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        return await route("/v1/chat/completions", await read_body(request), splittable=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        worker = instances.pick("decode")
        if worker is None:
            raise APIError(503, "no decode worker is up")
        try:
            reply = await client.get(f"{worker.url}/v1/models", headers=worker_headers)
        except httpx.HTTPError:
            worker.failed("unreachable")
            raise APIError(503, f"decode worker {worker.url} is unreachable") from None
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        """The OpenAPI schema, behind the key when one is set."""
        authorize(request)
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Up, degraded (some worker down) or down (no decode worker up). Each worker's URL, role and state
        only for a caller with the key (when one is set): the addresses behind the router are not public."""
        async def probe(worker: Instance) -> tuple[Instance, bool]:
            try:
                reply = await client.get(f"{worker.url}/health", timeout=2.0)
                return worker, reply.status_code == 200
            except httpx.HTTPError:
                return worker, False

        results = await asyncio.gather(*(probe(w) for w in instances.all()))
        try:
            authorize(request)
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

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
