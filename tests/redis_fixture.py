"""A real `redis-server` on a free loopback port, for the remote KV tier tests.

Skips (with the reason) when the `redis-server` binary or the `redis` package is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest

from sage_infer.hal.net import free_port

REDIS_MISSING = "redis-server not installed (apt-get install redis-server)"


@dataclass
class ServerProcess:
    """A server a test started on a loopback port (redis-server, mooncake_master)."""

    url: str
    port: int
    process: subprocess.Popen

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class RedisServer(ServerProcess):
    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)



def start_redis(port: int | None = None) -> RedisServer:
    """Start one server (on `port`, e.g. a killed one's again; else a free one) and wait until it answers PING
    (skips the test when Redis is not here)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(REDIS_MISSING)
    try:
        import redis
    except ImportError:
        pytest.skip("the redis package is not installed (pip install 'sage-infer[redis]')")
    port = port or free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(f"redis://127.0.0.1:{port}/0", port, process)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            if client.ping():
                break
        except redis.RedisError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"redis-server on port {port} did not answer PING")
        time.sleep(0.05)
    client.close()
    return server
