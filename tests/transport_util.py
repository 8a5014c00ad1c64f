"""Helpers shared by the transport tests: KV tensors, child processes, a fresh telemetry registry."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import zlib

import torch
from prometheus_client import CollectorRegistry

from sage_infer.config.transport import KVTransportConfig
from sage_infer.transport import KVReceiveBuffers, TransportEngine
from sage_infer.transport.telemetry import TransportTelemetry

SPAWN = mp.get_context("spawn")


def kv(seed: int, layers: int = 3, tokens: int = 700, heads: int = 4, head_dim: int = 64, dtype=torch.float16):
    """Per-layer KV tensors [2, tokens, heads, head_dim] with a few outliers."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        t = torch.randn(2, tokens, heads, head_dim, generator=g)
        t[0, :3] *= 40  # outlier tokens, as real K caches have
        out.append(t.to(dtype))
    return out


def digest(layers) -> int:
    crc = 0
    for t in layers:
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def engine(**cfg) -> TransportEngine:
    cfg.setdefault("timeout_s", 10)
    return TransportEngine(KVTransportConfig(**cfg), telemetry=TransportTelemetry(CollectorRegistry()))


def receiver_main(q, backend: str, request_ids, shape_kw, dtype_name: str, die_after: int | None = None,
                  send_back: bool = False) -> None:
    """Child process: listen, receive the listed requests into zeroed buffers, report digests."""
    import os
    import signal

    dtype = getattr(torch, dtype_name)

    async def main() -> None:
        eng = engine(backend=backend)
        listener = await eng.listen(backend)
        q.put(listener.address)
        loop = asyncio.get_running_loop()
        channel = await listener.accept(loop.time() + 20)
        buffers = KVReceiveBuffers()
        dests = {}
        for rid in request_ids:
            dests[rid] = [torch.zeros_like(t) for t in kv(0, dtype=dtype, **shape_kw)]
            buffers.register(rid, dests[rid])
        if die_after is not None:
            for _ in range(die_after):
                await eng.recv_kv_chunk(channel, buffers, deadline=loop.time() + 20)
            q.put("dying")
            q.close()
            q.join_thread()  # flushed before the kill
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            stats = await eng.receive(channel, buffers, request_ids, deadline_s=20)
        except Exception as err:  # reported to the test, which asserts on it
            q.put(("error", type(err).__name__, str(err)))
            return
        q.put({rid: (digest(dests[rid]), stats[rid].chunks, buffers.complete(rid)) for rid in request_ids})
        if send_back:  # the test compares values (lossy formats); a trusted local queue
            q.put({rid: [t.numpy().copy() for t in dests[rid]] for rid in request_ids})
        await channel.aclose()
        await listener.aclose()

    asyncio.run(main())
