"""`Connection`: one peer's send side, shared by every transfer to it, with a priority pump."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.interfaces.transport import KVChunk, TransportPlan
from sage_infer.transport.base import SendChannel
from sage_infer.transport.stats import TransferRecord
from sage_infer.transport.transport_errors import TransportError

if TYPE_CHECKING:
    from sage_infer.transport.engine import TransportEngine


@dataclass(slots=True)
class _Job:
    chunk: KVChunk
    layer: torch.Tensor
    plan: TransportPlan
    count: int
    stats: TransferRecord
    source: memoryview | None  # the layer's bytes on the host (None: made per chunk)
    done: asyncio.Future  # -> seconds from send to verified ACK


class Connection:
    """The sending side of one peer connection, shared by every transfer to that peer.

    Transfers queue their chunks here; one pump sends them in (priority, deadline,
    arrival) order as the in-flight window allows, so chunks of a decode-critical
    transfer go out before any bulk chunk still waiting, whenever they arrive."""

    def __init__(self, engine: TransportEngine, channel: SendChannel, address: str, backend: str) -> None:
        self.engine = engine
        self.channel = channel
        self.address = address
        self.backend = backend
        self.inflight_gauge = engine.telemetry.inflight.labels(backend)
        self.seq = itertools.count()
        self._arrivals = itertools.count()
        # (priority, deadline, arrival, job): compared as tuples, in C (a transfer queues every chunk at once, and a
        # dataclass's generated comparisons cost a dozen Python calls per pop)
        self._queue: list[tuple[int, float, int, _Job]] = []
        self._ready = asyncio.Event()
        self._pump = asyncio.get_running_loop().create_task(self._run())

    def submit(self, priority: int, deadline: float, chunk: KVChunk, layer: torch.Tensor, plan: TransportPlan,
               count: int, stats: TransferRecord, source: memoryview | None = None) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority, deadline, next(self._arrivals),
                                     _Job(chunk, layer, plan, count, stats, source, done)))
        self._ready.set()
        return done

    async def _run(self) -> None:
        # (Preparing the next chunk's CRC on a worker thread while this one is on the wire was
        # tried and measured no gain (`sage transport bench`), so the pump stays one simple loop.)
        while True:
            popped = self._pop_live()
            if popped is None:
                self._ready.clear()
                await self._ready.wait()
                continue
            deadline, job = popped
            try:  # the channel settles job.done itself when the receiver acknowledges the chunk
                await self.engine.send_kv_chunk(self, job.chunk, job.layer, job.plan, deadline=deadline,
                                                count=job.count, stats=job.stats, source=job.source, acked=job.done,
                                                ack_now=not self._queue)  # nothing queued: we wait for ACKs next
            except (TransportError, ValueError) as err:
                if not job.done.done():
                    job.done.set_exception(err)

    def _pop_live(self) -> tuple[float, _Job] | None:
        """(deadline, job) of the next chunk to send."""
        while self._queue:
            _, deadline, _, job = heapq.heappop(self._queue)
            if not job.done.done():  # skip chunks of transfers that gave up
                return deadline, job
        return None

    async def aclose(self) -> None:
        self._pump.cancel()
        for *_, job in self._queue:
            job.done.cancel()
        await self.channel.aclose()

