"""Start the real server (uvicorn on a free loopback port) in a thread, for tests."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from sage_infer.backends.native import NativeBackend
from sage_infer.config.serve import KVPoolConfig, ModelConfig, QuotaConfig, SchedulerConfig, ServeConfig, TierConfig
from sage_infer.server.launch import build_server


@dataclass
class RunningServer:
    url: str
    model: str
    backend: NativeBackend  # tests read its engine to check for leaked KV blocks
    app: object


@contextmanager
def running_server(model_dir, *, api_key: str | None = None, num_blocks: int = 128, max_num_seqs: int = 64,
                   max_waiting: int = 1024, drain_seconds: int = 5, tiers: TierConfig | None = None,
                   quota: QuotaConfig | None = None, role: str = "both", kv_transport: dict | None = None,
                   kv_dtype: str = "auto", speculative: dict | None = None, max_model_len: int | None = None,
                   kv_events: dict | None = None):
    config = ServeConfig(
        model=ModelConfig(path=str(model_dir), dtype="fp32", max_model_len=max_model_len),
        kv_pool=KVPoolConfig(num_blocks=num_blocks, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting),
        port=0,
        api_key=api_key,
        tiers=tiers or TierConfig(),
        quota=quota or QuotaConfig(),
        role=role,
        kv_transport=kv_transport or {},
        speculative=speculative or {},
        kv_events=kv_events or {},
    )
    server, backend, model_name = build_server(config, drain_seconds=drain_seconds)
    with serving(server) as url:
        yield RunningServer(url, model_name, backend, server.config.app)


@contextmanager
def serving(server):
    """Run a uvicorn.Server in a thread until the block ends; its URL."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def running_router(prefill_urls: list[str], decode_urls: list[str], api_key: str | None = None, config=None,
                   routing: str = "kv"):
    """The prefill/decode router in front of running workers (`routing` among the prefill ones); its URL."""
    from sage_infer.router.app import build_router
    from sage_infer.router.instances import Instances
    from sage_infer.server.launch import http_server

    app = build_router(Instances.of(prefill_urls, decode_urls), api_key, config, routing)
    server = http_server(app, "127.0.0.1", 0)
    with serving(server) as url:
        yield url


def post_raw(server: RunningServer, path: str, content: bytes | str, headers: dict | None = None) -> httpx.Response:
    """POST a body exactly as given (e.g. malformed JSON the openai client would never send)."""
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_openai_error(response: httpx.Response, status: int) -> str:
    """The response is an OpenAI-style JSON error with `status` and no traceback; returns its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == status
    assert "Traceback" not in response.text
    return error["message"]

