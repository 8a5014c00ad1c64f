"""What one shm chunk costs in CPU: sender and receiver in one process and one event loop.

    python bench/shm_chunk_cost.py --chunks 64KiB,1MiB,4MiB --checksum none --json out/shm_chunk_cost.json

Both ends of a real shm connection (Unix socket, shared-memory ring or zero-copy arena) run
as two tasks of one event loop on one thread, so the thread's CPU time per chunk is the
whole per-chunk price: both sides' Python work plus the copies (and CRCs), with no
cross-process wake-ups or scheduling in it. That makes it steady on a busy machine, where
`sage transport bench` (two processes, GB/s) swings by tens of percent. Small chunks show
the per-chunk Python work; large ones, how much of a chunk's time it still is. Median of
`--repeats` transfers of `--size` after a warm-up; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch
from pydantic import ByteSize, TypeAdapter

from sage_infer.config.transport import KVTransportConfig
from sage_infer.transport import KVReceiveBuffers, TransportEngine
from sage_infer.transport.arena import ALIGN, SharedArena
from sage_infer.transport.bench import LAYERS, kv_layers, kv_shape
from sage_infer.transport.telemetry import TransportTelemetry


async def chunk_cost(size: int, chunk: int, zero_copy: bool, checksum: str, repeats: int) -> dict:
    from prometheus_client import CollectorRegistry

    config = KVTransportConfig(backend="shm", chunk_size=chunk, max_inflight=8, checksum=checksum)
    engine = TransportEngine(config, telemetry=TransportTelemetry(CollectorRegistry()))
    arena = SharedArena(size + LAYERS * ALIGN + (1 << 20)) if zero_copy else None
    listener = await engine.listen("shm", arena=arena)
    accepting = asyncio.ensure_future(listener.accept(asyncio.get_running_loop().time() + 30))
    conn = await engine.connect(listener.address)
    channel = await accepting
    shape = kv_shape(size, torch.float16)
    if arena is not None:
        dest = [arena.tensor(shape, torch.float16) for _ in range(LAYERS)]
    else:
        dest = [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)]
    layers = kv_layers(size, torch.float16)
    per_chunk, chunks = [], 0
    for i in range(repeats + 1):
        buffers = KVReceiveBuffers()
        buffers.register(f"r{i}", dest)
        plan, _ = engine.plan(f"r{i}", layers)
        start = time.thread_time()
        sent, _ = await asyncio.gather(
            engine.stream_pipeline(conn, plan.chunks, plan, layers, deadline_s=120, wait_placement=zero_copy),
            engine.receive(channel, buffers, [f"r{i}"], deadline_s=120),
        )
        if i:  # the first one is a warm-up
            per_chunk.append((time.thread_time() - start) / sent.chunks)
        chunks = sent.chunks
    await conn.aclose()
    await channel.aclose()
    await listener.aclose()
    return {"chunk_bytes": chunk, "zero_copy": zero_copy, "checksum": checksum, "chunks_per_transfer": chunks,
            "cpu_us_per_chunk": statistics.median(per_chunk) * 1e6, "min_cpu_us_per_chunk": min(per_chunk) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="64MiB", help="KV bytes per transfer")
    parser.add_argument("--chunks", default="64KiB,1MiB,4MiB", help="chunk sizes, comma list")
    parser.add_argument("--checksum", default="none", choices=["none", "crc32c"])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sizes = TypeAdapter(ByteSize)
    size = int(sizes.validate_python(args.size))
    results = []
    for chunk in (int(sizes.validate_python(c)) for c in args.chunks.split(",")):
        for zero_copy in (False, True):
            results.append(asyncio.run(chunk_cost(size, chunk, zero_copy, args.checksum, args.repeats)))
    print(f"shm, {size >> 20} MiB per transfer, checksum {args.checksum}, sender + receiver on one thread")
    print(f"{'chunk':>9} {'mode':>9} {'chunks':>7} {'CPU µs/chunk':>13} {'min':>8}")
    for r in results:
        print(f"{r['chunk_bytes'] >> 10:>6} KiB {'zero-copy' if r['zero_copy'] else 'ring':>9} "
              f"{r['chunks_per_transfer']:>7} {r['cpu_us_per_chunk']:>13.1f} {r['min_cpu_us_per_chunk']:>8.1f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"size_bytes": size, "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
