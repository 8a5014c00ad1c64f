"""The fleet router: one OpenAI endpoint in front of N replicas that each run the whole model.

Each replica pushes its KV events (``GET /v1/kv/events/stream``: a snapshot, then every block
stored or removed on its device, host or disk tier or in the shared remote tier, and a load
heartbeat). The router folds them into one `FleetIndex` and, for each request, asks a
`kv_policy.routing.Router` for the replica: by default (``kv``) the one with the lowest
estimated time to first token, which weighs the prompt tokens it already holds (and where)
against the work queued there. The prediction is checked against what the replica reports
(``usage.prompt_tokens_details.cached_tokens``), as metrics.

Failures: a replica whose event stream breaks or falls silent for `SILENT_AFTER_S` is out of
the routing and its blocks are forgotten until it reconnects with a fresh snapshot. A request
that a replica did not start (unreachable, or a 503) goes to another one; a stream that breaks
after it started ends with an error event and ``[DONE]``. A replica that publishes no events
(a vLLM server without its events endpoint, prefix caching off) is routed to by load alone, its
liveness probed on ``/health``. A vLLM server given with its ZMQ events endpoint is routed
precisely: its events feed the same index (`router.vllm_fleet`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from sage_infer.errors import UsageError
from sage_infer.kv_policy.group_hit import window_needs
from sage_infer.kv_policy.routing import LOWER_MEDIA, SHARED, FleetIndex, Replica, Route, Router
from sage_infer.kv_policy.routing import Request as RouteRequest
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import make_extra_key, prompt_block_hashes
from sage_infer.router.http import (
    CALL_TIMEOUT,
    MATCH_FIELDS,
    cached_tokens,
    chained,
    encode,
    read_body,
    router_app,
    several_prompts,
    stream_error,
    up_to_first_token,
    usage_event,
    usage_of,
)
from sage_infer.router.local_prompts import LocalPrompts
from sage_infer.router.metrics import FleetMetrics
from sage_infer.router.responses import ResponsesRouting, chat_view
from sage_infer.router.vllm_events import VllmEndpoints, parse_replica
from sage_infer.router.vllm_fleet import describe_for_vllm, follow_vllm
from sage_infer.server.body import validate_body
from sage_infer.server.openai_errors import APIError, check_bearer
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("sage_infer.router")
SILENT_AFTER_S = 2.0  # a replica's event stream beats every 0.5 s: this long without a line and it is out
RECONNECT_S = 0.5  # between attempts to (re)open a replica's event stream
DOWN_FOR_S = 2.0  # a replica that failed a call is skipped this long (its events may still flow)
HEALTH_POLL_S = 1.0  # liveness of replicas that publish no events
HASHES_TIMEOUT_S = 2.0
ADD_PROBE_S = 5.0  # a replica added while the router runs must answer /v1/models within this
SESSION_CHARS = 512  # of a prompt's start, the session key when the request names no user or session
LONG_PROMPT_CHARS = 16_384  # a text prompt this long is tokenized on a worker thread
RANK_HEADER = "X-data-parallel-rank"  # vLLM (and SGLang) serve a request on the data-parallel rank it names
MAX_EXTRA_KEYS = 4096  # (recipe, cache salt) pairs whose extra key the router keeps


def _targets(url: str, endpoints: VllmEndpoints | None) -> list[tuple[str, str, VllmEndpoints | None, int | None]]:
    """The replicas behind one server URL as (name, URL, its events, rank): one, or one per data-parallel rank."""
    if endpoints is None or endpoints.ranks <= 1:
        return [(url, url, endpoints, None)]
    return [(f"{url}#dp{rank}", url, endpoints.of_rank(rank), rank) for rank in range(endpoints.ranks)]


class ReplicaUnreachable(Exception):
    """The chosen replica did not start the request: another one may."""


@dataclass(slots=True)
class ReplicaLink:
    """The router's connection to one replica: its event stream and whether it is in the routing."""

    url: str
    replica: Replica
    publishes: bool | None = None  # None until its event stream answered; False: routed by load alone
    connected: bool = False  # its event stream is open (or, without events, its /health answered)
    recipe: dict | None = None  # how it names its blocks (its snapshot says), for hashing token-id prompts here
    last_heard: float = 0.0
    down_until: float = 0.0
    vllm: VllmEndpoints | None = None  # a vLLM server's ZMQ KV events (`router.vllm_events`)
    rank: int | None = None  # a data-parallel rank of the server at `url`: requests name it (`RANK_HEADER`)

    @property
    def name(self) -> str:
        """The replica's name in the routing, metrics and logs: its URL, with ``#dp<rank>`` for a rank."""
        return self.replica.name

    def refresh(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.replica.up = self.connected and now >= self.down_until


class FleetRouter:
    """Routes OpenAI requests over `urls` by `routing` (see `kv_policy.routing.ROUTING_POLICIES`); `vllm_events`:
    replica URL -> where that vLLM server publishes its KV events. A vLLM server with data-parallel ranks is one
    replica per rank (``URL#dp<r>``: each rank has its own KV cache and events), its requests sent to the rank."""

    def __init__(self, urls: list[str], routing: str = "kv", api_key: str | None = None,
                 seed: int | None = None, vllm_events: dict[str, VllmEndpoints] | None = None,
                 prompts: LocalPrompts | None = None, metrics: FleetMetrics | None = None) -> None:
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("a fleet router needs at least one replica")
        vllm_events = {url.rstrip("/"): endpoints for url, endpoints in (vllm_events or {}).items()}
        targets = [target for url in urls for target in _targets(url, vllm_events.get(url))]
        self.index = FleetIndex([name for name, *_ in targets])
        self.links = {name: ReplicaLink(url, self.index.replica(name), vllm=endpoints, rank=rank)
                      for name, url, endpoints, rank in targets}
        for link in self.links.values():
            link.refresh()
        self.policy = Router(self.index, routing, seed)
        self.api_key = api_key
        self.prompts = prompts  # tokenizes text and messages here (else a replica is asked for their hashes)
        self.metrics = metrics or FleetMetrics()
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task] = {}  # replica name -> what follows its events (or health)
        self.responses = ResponsesRouting(lambda: self.client, self.headers, self.up_urls, self.choose_url,
                                          self.hold, lambda name, why: self.failed(self.links[name], why),
                                          lambda name: (self.links[name].url, self.rank_header(self.links[name])))
        self._extra_keys: dict[tuple, bytes] = {}  # (recipe, cache_salt) -> extra key

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=CALL_TIMEOUT, limits=httpx.Limits(max_connections=None,
                                                                                  max_keepalive_connections=64))
        for link in self.links.values():
            self._watch(link)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self.client.aclose()

    def _watch(self, link: ReplicaLink) -> None:
        self._tasks[link.name] = asyncio.create_task(follow_vllm(self, link) if link.vllm else self.follow(link))

    # -- membership (`POST` / `DELETE /v1/router/replicas`) ----------------------------------------

    def add(self, url: str, endpoints: VllmEndpoints | None = None) -> list[str]:
        """Put the server at `url` in the routing (one replica per data-parallel rank); its names. It routes once
        its event stream (or /health) answers, as a replica given at start does."""
        url = url.rstrip("/")
        targets = _targets(url, endpoints)
        taken = [name for name, *_ in targets if name in self.links]
        if taken:
            raise APIError(409, f"replica {taken[0]} is already in the routing", "url")
        for name, base, events, rank in targets:
            link = self.links[name] = ReplicaLink(base, self.index.add(name), vllm=events, rank=rank)
            link.refresh()
            self._watch(link)
        log.info("replica %s added to the routing", url)
        return [name for name, *_ in targets]

    async def remove(self, url: str) -> list[str]:
        """Take the server at `url` out of the routing (every rank of it), its blocks forgotten; requests in flight
        there finish. Its names."""
        url = url.rstrip("/")
        names = [name for name, link in self.links.items() if link.url == url]
        if not names:
            raise APIError(404, f"no replica at {url} in the routing", "url")
        if len(names) == len(self.links):
            raise APIError(409, "the router's last replica stays: add another before removing it", "url")
        for name in names:
            task = self._tasks.pop(name)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            link = self.links.pop(name)
            self.index.remove(link.replica)
            self.metrics.replica_up.labels(name).set(0)
        log.info("replica %s removed from the routing", url)
        return names

    # -- events ----------------------------------------------------------------------------------

    async def follow(self, link: ReplicaLink) -> None:
        """Keep `link`'s replica in the index from its pushed events, reconnecting when the stream ends."""
        timeout = httpx.Timeout(connect=2.0, read=SILENT_AFTER_S, write=5.0, pool=5.0)
        while True:
            why = "its event stream ended"
            try:
                async with self.client.stream("GET", f"{link.url}/v1/kv/events/stream", headers=self.headers,
                                              timeout=timeout) as reply:
                    if reply.status_code == 404:  # no events here: route by load, watch /health
                        link.publishes = False
                        await self.watch_health(link)
                        continue
                    if reply.status_code != 200:
                        why = f"its event stream answered HTTP {reply.status_code}"
                    else:
                        link.publishes = True
                        async for line in reply.aiter_lines():
                            if line:
                                self.on_event(link, json.loads(line))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
                why = f"its event stream failed: {err or type(err).__name__}"
            self.lost(link, why)
            await asyncio.sleep(RECONNECT_S)

    def on_event(self, link: ReplicaLink, message: dict) -> None:
        replica, kind = link.replica, message["type"]
        link.last_heard = time.monotonic()
        if kind == "snapshot":
            self.index.reset(replica, message["blocks"])
            link.recipe = message.get("recipe")
            replica.capacity_blocks = int((link.recipe or {}).get("num_blocks") or 0)
            replica.group_needs = _group_needs(link.recipe)
            link.connected = True
            link.refresh()
        elif kind == "events":
            for op, medium, block_hash in message["events"]:
                self.index.apply(replica, op, medium, block_hash)
        elif kind == "load":  # the heartbeat
            link.refresh()
        if kind != "load":
            for medium in ("device", *LOWER_MEDIA, SHARED):
                self.metrics.replica_blocks.labels(link.name, medium).set(self.index.blocks_in(replica, medium))
        self.metrics.replica_up.labels(link.name).set(int(replica.up))

    async def watch_health(self, link: ReplicaLink) -> None:
        """A replica without events: in the routing while its /health answers 200."""
        while True:
            try:
                ok = (await self.client.get(f"{link.url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                return
            link.connected, link.last_heard = True, time.monotonic()
            link.refresh()
            self.metrics.replica_up.labels(link.name).set(int(link.replica.up))
            await asyncio.sleep(HEALTH_POLL_S)

    def lost(self, link: ReplicaLink, why: str) -> None:
        if link.connected:
            self.metrics.lost.labels(link.name).inc()
            log.warning("replica %s is out of the routing: %s", link.name, why)
        link.connected = False
        self.index.drop(link.replica)
        link.refresh()
        self.metrics.replica_up.labels(link.name).set(0)

    def failed(self, link: ReplicaLink, why: str) -> None:
        """A call to the replica failed: out of the routing for `DOWN_FOR_S` (its event stream may say more)."""
        link.down_until = time.monotonic() + DOWN_FOR_S
        link.refresh()
        log.warning("replica %s skipped for %.0f s: %s", link.name, DOWN_FOR_S, why)
        self.metrics.failures.labels(link.name, "replica").inc()
        self.metrics.replica_up.labels(link.name).set(0)

    # -- requests --------------------------------------------------------------------------------

    async def describe(self, body: dict, headers: Mapping[str, str]) -> RouteRequest:
        """What the policy needs: under kv, the prompt's block hashes as the sage replicas name blocks (hashed here
        for token ids, and for text and messages the router tokenizes itself; else asked of one: it tokenizes and
        hashes as it caches) and as the vLLM replicas' events name them; under session, a session key."""
        described = RouteRequest(prompt_tokens=0, session=_session_key(body, headers))
        if not self.policy.needs_hashes or several_prompts(body):
            return described
        # a long text takes milliseconds to tokenize: off the event loop, which relays every other stream
        hashed = await asyncio.to_thread(self.hash_here, body, described) if _long(body) \
            else self.hash_here(body, described)
        if hashed:
            await describe_for_vllm(self, body, described)
        else:  # two round trips at once where the fleet has both kinds: one to a sage replica, one to a vLLM one
            await asyncio.gather(self.ask_hashes(body, described), describe_for_vllm(self, body, described))
        return described

    async def ask_hashes(self, body: dict, described: RouteRequest) -> None:
        """The prompt's block hashes as the sage replicas name them, asked of one (it tokenizes and hashes)."""
        question = {k: body[k] for k in MATCH_FIELDS if k in body}
        publishing = [link for link in self.links.values() if link.replica.up and link.publishes and not link.vllm]
        reply = await self.ask_least_busy(publishing, "/v1/kv/hashes", question, HASHES_TIMEOUT_S)
        if reply is not None and reply.status_code == 200:  # a 4xx: the replica that serves it says the same
            answer = reply.json()
            described.hashes, described.prompt_tokens = answer["hashes"], answer["prompt_tokens"]
            described.tokens_per_block = answer["tokens_per_hash"]

    async def ask_least_busy(self, links: list[ReplicaLink], path: str, question: dict,
                             timeout: float) -> httpx.Response | None:
        """POST `question` at `path` of the two least busy of `links`, in turn: the first reply that is not a server
        error (a 4xx included: the replica that serves the request would answer the client the same); None when
        neither gave one."""
        for link in sorted(links, key=lambda link: link.replica.outstanding)[:2]:
            try:
                reply = await self.client.post(f"{link.url}{path}", content=encode(question), headers=self.headers,
                                               timeout=timeout)
            except httpx.HTTPError:
                continue
            if reply.status_code < 500:
                return reply
        return None

    def hash_here(self, body: dict, described: RouteRequest) -> bool:
        """Hash the prompt in the router, as the replicas' snapshots say they name blocks (no round trip to a
        replica): token ids as given, text and messages tokenized by `prompts`; False without them, or when no
        replica said how it hashes."""
        recipe = next((link.recipe for link in self.links.values() if link.replica.up and link.recipe), None)
        if recipe is None:
            return False
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt) else None
        if ids is None and self.prompts is not None:
            ids = self.prompts.token_ids(body)
        if ids is None:
            return False
        salt = body.get("cache_salt")
        parts = (recipe["model_id"], recipe["revision"], recipe["kv_dtype"], recipe["layout"])
        key = self._extra_keys.get((parts, salt))
        if key is None:
            if len(self._extra_keys) >= MAX_EXTRA_KEYS:
                self._extra_keys.clear()
            key = self._extra_keys[(parts, salt)] = make_extra_key(*parts, salt)
        try:
            hashes = prompt_block_hashes(ids, recipe["block_size"], key)
        except ValueError:  # ids out of int64 range: the replica's 400 says so
            return False
        described.hashes = [short(h) for h in hashes]
        described.prompt_tokens, described.tokens_per_block = len(ids), recipe["block_size"]
        return True

    async def handle(self, path: str, request: Request) -> Response:
        check_bearer(request.headers.get("authorization", ""), self.api_key)
        body = await read_body(request)
        validate_body(body, CompletionRequest if path == "/v1/completions" else ChatCompletionRequest)
        started = time.perf_counter()
        described = await self.describe(body, request.headers)
        tried: set[str] = set()
        while (route := self.policy.route(described, exclude=tried)) is not None:
            tried.add(route.replica.name)
            if len(tried) == 1:
                self.metrics.overhead.observe(time.perf_counter() - started)
                if route.moved:
                    self.metrics.moved.inc()
            link = self.links[route.replica.name]
            try:
                if body.get("stream"):
                    return await self.stream(link, route, path, body, described)
                return await self.call(link, route, path, body, described)
            except ReplicaUnreachable:
                self.metrics.fleet_retries.inc()
        raise APIError(503, "no replica is up" if not tried else "no replica could take the request")

    def enter(self, link: ReplicaLink, route: Route, described: RouteRequest) -> int:
        """Count the request at its replica; the prompt tokens it will compute there (queued until its first
        token)."""
        queued = route.compute_tokens
        link.replica.take(queued, route.blocks)
        self.metrics.routed.labels(link.name, "replica").inc()
        self.metrics.outstanding.labels(link.name, "replica").set(link.replica.outstanding)
        return queued

    def leave(self, link: ReplicaLink, route: Route, queued: int, finished: bool = True) -> None:
        link.replica.release(queued, finished, route.blocks if finished else ())
        if finished:
            self.metrics.outstanding.labels(link.name, "replica").set(link.replica.outstanding)

    def check_prediction(self, route: Route, described: RouteRequest, usage: dict) -> None:
        reported = cached_tokens(usage)
        if reported is None or not described.blocks_for(route.replica)[0]:
            return
        predicted = route.hit.blocks * route.tokens_per_block
        self.metrics.prompt_tokens.inc(described.prompt_tokens)
        self.metrics.overlap_tokens.inc(predicted)
        self.metrics.predicted_cached.inc(predicted)
        self.metrics.reported_cached.inc(reported)
        self.metrics.prediction_error.inc(abs(predicted - reported))

    def first_token(self, route: Route, seconds: float) -> None:
        """A streamed request's first token came `seconds` after it was sent: check and refine the prediction."""
        if route.predicted_ttft_s is None:
            return
        self.metrics.ttft_error.inc(abs(seconds - route.predicted_ttft_s))
        self.metrics.ttft_observed.inc(seconds)
        self.policy.learn(route, seconds)

    async def call(self, link: ReplicaLink, route: Route, path: str, body: dict,
                   described: RouteRequest) -> Response:
        queued = self.enter(link, route, described)
        try:
            reply = await self.client.post(f"{link.url}{path}", content=encode(body),
                                           headers=self.headers_for(link))
        except httpx.HTTPError as err:
            self.failed(link, str(err) or type(err).__name__)
            raise ReplicaUnreachable from None
        finally:
            self.leave(link, route, queued)
        if reply.status_code == 503:  # not started there (shutting down, queue full): another replica may take it
            self.failed(link, "HTTP 503")
            raise ReplicaUnreachable
        if reply.status_code == 200:
            self.check_prediction(route, described, usage_of(reply))
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    async def stream(self, link: ReplicaLink, route: Route, path: str, body: dict,
                     described: RouteRequest) -> Response:
        """Relay the replica's SSE stream; the router asks for the final usage (its cached tokens check the
        prediction) and passes it on only to a client that asked for it."""
        options = body.get("stream_options") or {}
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        if isinstance(options, dict):
            body = {**body, "stream_options": {**options, "include_usage": True}}
        queued = self.enter(link, route, described)
        sent = time.monotonic()
        try:
            request = self.client.build_request("POST", f"{link.url}{path}", content=encode(body),
                                                headers=self.headers_for(link))
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as err:
            self.leave(link, route, queued)
            self.failed(link, str(err) or type(err).__name__)
            raise ReplicaUnreachable from None
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self.leave(link, route, queued)
            if upstream.status_code == 503:
                self.failed(link, "HTTP 503")
                raise ReplicaUnreachable
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        try:  # nothing goes to the client before the first token: a replica that dies before it loses no request
            head, chunks = await up_to_first_token(upstream)
        except (httpx.HTTPError, StopAsyncIteration) as err:
            await upstream.aclose()
            self.leave(link, route, queued)
            self.failed(link, f"its stream ended before its first token ({err or type(err).__name__})")
            raise ReplicaUnreachable from None
        relay = _Relay(self, link, route, described, upstream, queued, wants_usage, sent)
        return StreamingResponse(relay.events(head, chunks), media_type="text/event-stream",
                                 background=BackgroundTask(relay.finish))

    # -- /v1/responses (router.responses) ---------------------------------------------------------

    def up_urls(self) -> list[str]:
        """The replicas in the routing by name, least busy first (a name stands for a URL and a rank: `address`)."""
        return [link.name for link in sorted(self.links.values(), key=lambda link: link.replica.outstanding)
                if link.replica.up]

    @staticmethod
    def rank_header(link: ReplicaLink) -> dict[str, str]:
        """What sends a request to the link's data-parallel rank (nothing for a server without ranks)."""
        return {} if link.rank is None else {RANK_HEADER: str(link.rank)}

    def headers_for(self, link: ReplicaLink) -> dict[str, str]:
        """The router's headers to a replica, with what names its data-parallel rank."""
        return {**self.headers, **self.rank_header(link)}

    async def choose_url(self, body: dict, request: Request, exclude: set[str]) -> str | None:
        """A new conversation's replica: where the policy sends a chat request with its first turn's messages."""
        view = chat_view(body)
        described = await self.describe(view, request.headers) if view else \
            RouteRequest(prompt_tokens=0, session=_session_key(body, request.headers))
        route = self.policy.route(described, exclude=exclude)
        return route.replica.name if route is not None else None

    def hold(self, url: str):
        """Count a request in flight at `url`'s replica until the returned function is called."""
        link = self.links[url]
        link.replica.take(0)
        return lambda: link.replica.release(0)

    # -- other routes ----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        check_bearer(request.headers.get("authorization", ""), self.api_key)
        for link in sorted(self.links.values(), key=lambda link: not link.replica.up):
            try:
                reply = await self.client.get(f"{link.url}/v1/models", headers=self.headers)
            except httpx.HTTPError as err:
                self.failed(link, str(err) or type(err).__name__)
                continue
            return Response(reply.content, status_code=reply.status_code, media_type="application/json")
        raise APIError(503, "no replica is up")

    def health(self, request: Request) -> JSONResponse:
        """ok (every replica in the routing), degraded (some), down (none: 503). Each replica's URL and state only
        for a caller with the key (when one is set): the addresses behind the router are not public."""
        up = sum(link.replica.up for link in self.links.values())
        try:
            check_bearer(request.headers.get("authorization", ""), self.api_key)
            replicas: dict = {url: {"up": link.replica.up, "events": link.publishes,
                                    "outstanding": link.replica.outstanding} for url, link in self.links.items()}
        except APIError:
            replicas = {"up": up, "total": len(self.links)}
        status = "down" if up == 0 else "ok" if up == len(self.links) else "degraded"
        return JSONResponse({"status": status, "routing": self.policy.policy, "replicas": replicas},
                            status_code=503 if up == 0 else 200)


class _Relay:
    """One streamed answer on its way from a replica to the client."""

    def __init__(self, router: FleetRouter, link: ReplicaLink, route: Route, described: RouteRequest,
                 upstream: httpx.Response, queued: int, wants_usage: bool, sent: float) -> None:
        self.router, self.link, self.route, self.described = router, link, route, described
        self.upstream, self.queued, self.wants_usage, self.sent = upstream, queued, wants_usage, sent
        self.first = False
        self.done = False

    async def events(self, head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Relay `head` (the stream up to its first token, read before the client was answered) and then `rest`."""
        # the first token came: its prompt is computed, no longer queued there
        self.first = True
        self.router.leave(self.link, self.route, self.queued, finished=False)
        self.router.first_token(self.route, time.monotonic() - self.sent)
        pending = b""
        try:
            async for chunk in chained(head, rest):
                *events, pending = (pending + chunk).split(b"\n\n")
                relayed = []
                for event in events:
                    usage = usage_event(event)
                    if usage is not None:
                        self.router.check_prediction(self.route, self.described, usage)
                        if not self.wants_usage:
                            continue
                    relayed.append(event + b"\n\n")
                if relayed:
                    yield b"".join(relayed)
        except httpx.HTTPError as err:  # the replica died mid-stream: end the stream with an error event
            self.router.failed(self.link, str(err) or type(err).__name__)
            yield stream_error(f"replica {self.link.name} stopped during the request")
        finally:
            await self.finish()

    async def finish(self) -> None:
        """Once, however the stream ends (finished, replica gone, client gone before the first byte)."""
        if self.done:
            return
        self.done = True
        await self.upstream.aclose()
        self.router.leave(self.link, self.route, 0 if self.first else self.queued)


def _group_needs(recipe: dict | None) -> tuple[int, ...]:
    """A replica with KV groups (sliding-window layers: its recipe lists them): per group the blocks a prefix hit
    needs there; () for one full-attention group."""
    groups, block_size = (recipe or {}).get("kv_groups"), (recipe or {}).get("block_size")
    return window_needs(groups, int(block_size)) if groups and block_size else ()


def _long(body: dict) -> bool:
    """Whether tokenizing the prompt here is long work (its text passes `LONG_PROMPT_CHARS`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt) > LONG_PROMPT_CHARS
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)) \
        > LONG_PROMPT_CHARS


def _session_key(body: dict, headers: Mapping[str, str]) -> str:
    """The request's session: its ``user``, an ``X-Session-Id`` header, else the start of its prompt."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    header = headers.get("x-session-id")
    if header:
        return "session:" + header
    start = body.get("messages") if "messages" in body else body.get("prompt")
    return "prompt:" + json.dumps(start, ensure_ascii=True)[:SESSION_CHARS]


def build_fleet_app(router: FleetRouter) -> FastAPI:
    """The HTTP face of `router`: the client routes a replica answers, plus the router's own health and metrics."""
    app = router_app("sage_infer fleet router", router)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        return router.health(request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/router/replicas", include_in_schema=False)
    async def replicas(request: Request) -> JSONResponse:
        _check_admin(router, request)
        return JSONResponse({"object": "list", "data": [
            {"name": name, "url": link.url, "rank": link.rank, "up": link.replica.up, "events": link.publishes,
             "outstanding": link.replica.outstanding} for name, link in router.links.items()]})

    @app.post("/v1/router/replicas", include_in_schema=False)
    async def add_replica(request: Request) -> JSONResponse:
        _check_admin(router, request)
        url, endpoints = _replica_of(await read_body(request))
        try:
            reply = await router.client.get(f"{url}/v1/models", headers=router.headers, timeout=ADD_PROBE_S)
        except httpx.HTTPError as err:
            raise APIError(400, f"replica {url} does not answer ({err or type(err).__name__})", "url") from None
        if reply.status_code != 200:
            raise APIError(400, f"replica {url}: /v1/models answered HTTP {reply.status_code}", "url")
        return JSONResponse({"added": router.add(url, endpoints)}, status_code=201)

    @app.delete("/v1/router/replicas", include_in_schema=False)
    async def remove_replica(request: Request, url: str = "") -> JSONResponse:
        _check_admin(router, request)
        if not url:
            raise APIError(400, "name the replica to remove: DELETE /v1/router/replicas?url=URL", "url")
        return JSONResponse({"removed": await router.remove(url)})

    return app


def _check_admin(router: FleetRouter, request: Request) -> None:
    """Managing replicas needs the router's key: the router sends it (and its clients' bearers) to every replica,
    so without one nobody may name where traffic goes."""
    if router.api_key is None:
        raise APIError(403, "managing replicas needs the router's API key (start it with --api-key): the router "
                       "forwards keys to every replica it routes to")
    check_bearer(request.headers.get("authorization", ""), router.api_key)


def _replica_of(body: dict) -> tuple[str, VllmEndpoints | None]:
    """A replica to add, from ``{"url": ..., "events": ..., "replay": ..., "topic": ..., "dp": N}`` (the fields of
    ``--replica URL,events=...``); a 400 naming the field otherwise."""
    fields = {key: body.get(key) for key in ("url", "events", "replay", "topic", "dp") if body.get(key) is not None}
    unknown = sorted(set(body) - {"url", "events", "replay", "topic", "dp"})
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}: expected url, events, replay, topic, dp", unknown[0])
    for key, value in fields.items():
        if not isinstance(value, int if key == "dp" else str) or isinstance(value, bool) or "," in str(value):
            raise APIError(400, f"{key}: expected {'an integer' if key == 'dp' else 'a string without commas'}", key)
    if "url" not in fields:
        raise APIError(400, "url: the replica's http(s) URL is required", "url")
    try:
        return parse_replica(",".join([fields.pop("url"), *(f"{k}={v}" for k, v in fields.items())]))
    except UsageError as err:
        raise APIError(400, str(err).removeprefix("--replica "), "url") from None
