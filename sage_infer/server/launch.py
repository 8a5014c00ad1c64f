"""`sage llm serve`: build the backend, start uvicorn on loopback, drain on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from sage_infer.config.serve import ServeConfig

HEALTH_WATCH_S = 0.25  # how often the server asks its backend whether the engine still runs
STATS_LOG_S = 10.0  # `sage llm serve` prints throughput, load, KV use and acceptance this often while it works
# An idle keep-alive connection stays open this long. Client pools keep idle connections for 5 s (httpx, so the
# openai client) or 15 s (aiohttp); a server that closes first races a client reusing the connection at that moment,
# and the request fails with "server disconnected" (uvicorn's own default is 5 s).
KEEP_ALIVE_S = 30
DRAIN_MARGIN_S = 1.0  # requests still running this long before the drain ends are cut off with an error


def ready_message(host: str, port: int, model_name: str, api_key: bool) -> str:
    url = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $SAGE_API_KEY"' if api_key else ""
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Speak, friend."}],
                       "max_tokens": 32})
    return (f"sage_infer serving {model_name} at {url}/v1\n"
            f"try:\n  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")


def build_server(config: ServeConfig, drain_seconds: int | None = None, log_stats: bool = False):
    """Backend + app + a uvicorn.Server that has not started yet.

    The backend comes from the registry by `config.backend`; one that cannot run here
    raises `ConfigError` before anything listens. `log_stats`: print a `StatsLog` line every `STATS_LOG_S`
    while requests run (`sage llm serve` does). `drain_seconds`: the shutdown's drain, `config.drain_timeout_s` unless
    given.
    """
    from sage_infer.backends.registry import create_backend
    from sage_infer.server.api import build_app
    from sage_infer.server.chat_answer import ChatFeatures
    from sage_infer.server.metrics import StatsLog

    drain_seconds = config.drain_timeout_s if drain_seconds is None else drain_seconds
    backend = create_backend(config)
    model_name = backend.model_info().name
    api_key = config.api_key.get_secret_value() if config.api_key else None
    responses_dir = str(Path(config.tiers.disk_path) / "responses") if config.tiers.disk_path else None
    chat_features = ChatFeatures(config.model.tool_call_parser, config.model.reasoning_parser)
    app = build_app(backend, api_key, allowed_peers=config.kv_transport.allowed_peers, responses=config.responses,
                    responses_dir=responses_dir, chat_features=chat_features)
    publisher = None
    if config.kv_events.publisher == "zmq":  # vLLM-format events for routers built for vLLM
        from sage_infer.server.kv_events_zmq import ZmqEventPublisher

        try:
            publisher = ZmqEventPublisher(backend, config.kv_events)
        except Exception:
            backend.shutdown(5.0)
            raise

    async def watch() -> None:
        """Two things no request sees coming. An engine that died answers every request 503, so the process must
        end for a supervisor (systemd, Kubernetes, `--pd`'s launcher) to start a new one: stop the server the
        moment health says so. A shutdown (SIGTERM) waits `drain_seconds` for requests to finish, then drops the
        connections: just before that, end what still runs with an error the client can read (a stream's error
        event and ``[DONE]``), its KV freed."""
        cut_at = None
        stats_log, next_line = StatsLog(app.state.metrics, backend), asyncio.get_running_loop().time() + STATS_LOG_S
        while True:
            await asyncio.sleep(HEALTH_WATCH_S)
            if log_stats and asyncio.get_running_loop().time() >= next_line:
                next_line += STATS_LOG_S
                if (line := await asyncio.to_thread(stats_log.line)) is not None:
                    print(line, file=sys.stderr, flush=True)
            if server.should_exit and app.state.failed is None:
                app.state.closing = True
                now = asyncio.get_running_loop().time()
                if cut_at is None:
                    cut_at = now + max(0.0, drain_seconds - DRAIN_MARGIN_S)
                elif now >= cut_at:
                    app.state.handlers.cut_off(f"the server is shutting down and this request did not finish "
                                               f"within its {drain_seconds} s drain")
                    return
                continue
            status = backend.health()
            if not status.ok:
                print(f"sage: error: {status.reason}; stopping the server (exit code 1) so that it can be "
                      "restarted", file=sys.stderr, flush=True)
                app.state.failed = status.reason
                server.should_exit = app.state.closing = True
                return

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        backend.start()
        watcher = asyncio.create_task(watch())
        yield
        watcher.cancel()
        app.state.accepting = False
        if publisher is not None:
            publisher.close()
        await asyncio.to_thread(backend.shutdown, 5.0)

    app.router.lifespan_context = lifespan
    app.state.failed = None  # why the server stopped itself (the engine died), else None
    server = http_server(app, config.host, config.port, timeout_graceful_shutdown=drain_seconds)
    return server, backend, model_name


def http_server(app, host: str, port: int, **options):
    """The uvicorn server every sage HTTP front end runs (the model server, the P/D router): quiet, no access log,
    idle connections kept `KEEP_ALIVE_S`."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         timeout_keep_alive=KEEP_ALIVE_S, **options))


def serve(config: ServeConfig) -> int:
    """Run until SIGINT/SIGTERM; in-flight requests get `config.drain_timeout_s` to finish. Exit code 0, or 1 when the
    engine died (the server stops itself then, so a supervisor restarts it)."""
    server, _, model_name = build_server(config, log_stats=True)
    # uvicorn re-raises the signal it caught after its graceful shutdown; with these
    # handlers in place that re-raise is a no-op and the process exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)

    code = run_announced(server, config.host, config.port,
                         lambda port: ready_message(config.host, port, model_name, config.api_key is not None))
    return 1 if server.config.app.state.failed is not None else code


def run_announced(server, host: str, port: int, ready_line: Callable[[int], str]) -> int:
    """Run a uvicorn.Server until it stops; once it listens, print ``ready_line(bound port)``.
    Exit code 0, or 1 (with one line on stderr) when it could not listen."""

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        print(ready_line(bound), flush=True)

    async def main() -> None:
        announcer = asyncio.create_task(announce())
        with contextlib.suppress(asyncio.CancelledError):
            await server.serve()
        announcer.cancel()

    asyncio.run(main())
    if not server.started:
        print(f"sage: error: could not listen on {host}:{port}", file=sys.stderr)
        return 1
    return 0
