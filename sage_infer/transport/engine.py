"""`TransportEngine`: plan, convert, chunk, send and verify KV between two processes.

Sender::

    engine = TransportEngine(config, hardware)
    conn = await engine.connect("shm:///tmp/sage-shm-x/ctl.sock")
    plan, _ = engine.plan("req-1", layers)                # layers: one contiguous tensor per layer
    stats = await engine.stream_pipeline(conn, plan.chunks, plan, layers, priority=Priority.DECODE)

Receiver::

    listener = await engine.listen("shm")
    channel = await listener.accept(deadline)
    buffers = KVReceiveBuffers(); buffers.register("req-1", dest_layers)
    stats = await engine.receive(channel, buffers, ["req-1"])

A chunk is marked delivered only after its CRC checked out at the receiver (and, for
a converted chunk, after it was decoded into place). A transfer that fails leaves its
request with nothing marked delivered, so no half-written block is ever used.
Several transfers may share one connection: each chunk waits for its turn in
(priority, deadline) order, so a decode-critical transfer overtakes bulk prefetch
at the next chunk boundary.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sage_infer.config.hardware import HardwareProfile
from sage_infer.config.transport import KVTransportConfig
from sage_infer.interfaces.transport import KVChunk, TransportPlan
from sage_infer.transport.arena import SharedArena
from sage_infer.transport.base import Listener, RecvChannel, SendChannel, before, get_backend
from sage_infer.transport.errors import PeerClosedError, ProtocolError, TransportError
from sage_infer.transport.format import converter
from sage_infer.transport.planner import PlannedTransfer, TransferPlanner, wire_name
from sage_infer.transport.telemetry import TransportTelemetry
from sage_infer.transport.wire import ChunkHeader, Flag, Kind, checksum

TORCH_OF = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHM_RING_BYTES = 8 * 1024 * 1024  # small enough to stay in the last-level cache (measured best of 4-32 MiB)


class Priority(enum.IntEnum):
    """Lower goes first."""

    DECODE = 0  # a decode step is waiting for this KV
    PREFILL = 5
    PREFETCH = 10  # bulk, speculative


@dataclass(slots=True)
class TransferStats:
    request_id: str
    backend: str
    direction: str  # send / recv
    chunks: int = 0
    bytes: int = 0  # KV bytes as stored
    wire_bytes: int = 0  # bytes on the wire (smaller when converted)
    seconds: float = 0.0
    convert_seconds: float = 0.0
    retransmits: int = 0
    chunk_seconds: list[float] = field(default_factory=list)  # send → verified ACK, per chunk

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def chunk_us(self, q: float) -> float:
        return float(np.quantile(self.chunk_seconds, q)) * 1e6 if self.chunk_seconds else 0.0


@dataclass(slots=True)
class _Prepared:
    fields: dict
    flags: Flag
    payload: memoryview
    crc: int
    convert_seconds: float


@dataclass(order=True, slots=True)
class _Job:
    priority: int
    deadline: float
    arrival: int
    chunk: KVChunk = field(compare=False)
    layer: torch.Tensor = field(compare=False)
    plan: TransportPlan = field(compare=False)
    count: int = field(compare=False)
    stats: TransferStats = field(compare=False)
    done: asyncio.Future = field(compare=False)  # -> seconds from send to verified ACK


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
        self.seq = itertools.count()
        self._arrivals = itertools.count()
        self._queue: list[_Job] = []
        self._ready = asyncio.Event()
        self._pump = asyncio.get_running_loop().create_task(self._run())

    def submit(self, priority: int, deadline: float, chunk: KVChunk, layer: torch.Tensor, plan: TransportPlan,
               count: int, stats: TransferStats) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, _Job(priority, deadline, next(self._arrivals), chunk, layer, plan, count,
                                         stats, done))
        self._ready.set()
        return done

    async def _run(self) -> None:
        # (Preparing the next chunk's CRC on a worker thread while this one is on the wire was
        # tried and measured: no gain on 2 vCPUs, so the pump stays one simple loop.)
        while True:
            job = self._pop_live()
            if job is None:
                self._ready.clear()
                await self._ready.wait()
                continue
            try:
                acked = await self.engine.send_kv_chunk(self, job.chunk, job.layer, job.plan, deadline=job.deadline,
                                                        count=job.count, stats=job.stats)
            except (TransportError, ValueError) as err:
                if not job.done.done():
                    job.done.set_exception(err)
                continue
            acked.add_done_callback(lambda ack, done=job.done: _settle(done, ack))

    def _pop_live(self) -> _Job | None:
        while self._queue:
            job = heapq.heappop(self._queue)
            if not job.done.done():  # skip chunks of transfers that gave up
                return job
        return None

    async def aclose(self) -> None:
        self._pump.cancel()
        for job in self._queue:
            job.done.cancel()
        await self.channel.aclose()


def _settle(done: asyncio.Future, ack: asyncio.Future) -> None:
    if done.done():
        return
    if ack.cancelled():
        done.cancel()
    elif ack.exception() is not None:
        done.set_exception(ack.exception())
    else:
        done.set_result(ack.result())


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    if not tensor.is_contiguous():
        raise ValueError("KV tensors must be contiguous to be sent or received in place")
    return tensor.reshape(-1).view(torch.uint8)


def _host_view(u8: torch.Tensor) -> memoryview:
    if u8.device.type != "cpu":  # socket/shm backends stage device KV through host memory
        u8 = u8.to("cpu")
    return memoryview(u8.numpy())


class KVReceiveBuffers:
    """Destination tensors registered per request; tracks which chunks are verified in place."""

    def __init__(self) -> None:
        self._layers: dict[str, list[torch.Tensor]] = {}
        self._bytes: dict[str, list[torch.Tensor]] = {}
        self._done: dict[str, set[int]] = {}
        self._expected: dict[str, int] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)

    def register(self, request_id: str, layers: Sequence[torch.Tensor]) -> None:
        self._layers[request_id] = list(layers)
        self._bytes[request_id] = [as_bytes(t) for t in layers]
        self._done[request_id] = set()
        self._expected.pop(request_id, None)

    def release(self, request_id: str) -> None:
        for table in (self._layers, self._bytes, self._done, self._expected):
            table.pop(request_id, None)

    def sink(self, header: ChunkHeader) -> memoryview:
        """Where this chunk's payload goes: straight into the layer, or a staging buffer
        when it must be decoded first."""
        if header.request_id not in self._bytes:
            raise ProtocolError(f"no receive buffers registered for request {header.request_id!r}")
        if header.converted:
            if self._staging.numel() < header.length:
                self._staging = torch.empty(header.length, dtype=torch.uint8)
            return memoryview(self._staging[: header.length].numpy())
        return memoryview(self._region(header, header.length).numpy())

    def _region(self, header: ChunkHeader, length: int) -> torch.Tensor:
        layers = self._bytes[header.request_id]
        if header.layer >= len(layers):
            raise ProtocolError(f"chunk for layer {header.layer}, but request {header.request_id!r} has {len(layers)}")
        dest = layers[header.layer]
        if header.offset + length > dest.numel():
            raise ProtocolError(
                f"chunk {header.chunk_index} of layer {header.layer} ends at byte {header.offset + length}, "
                f"past the {dest.numel()}-byte destination"
            )
        return dest[header.offset : header.offset + length]

    def land(self, header: ChunkHeader) -> float:
        """Decode a verified converted chunk into place (returns seconds spent); mark it delivered."""
        spent = 0.0
        if header.converted:
            start = time.perf_counter()
            region = self._region(header, header.raw_length)
            dtype = TORCH_OF[header.src_dtype]
            out = region.view(dtype).view(-1, header.cols)
            converter.decode(self._staging[: header.length], header.wire_dtype, out.shape[0], header.cols, dtype,
                             header.granularity, header.group_size or None, out=out)
            spent = time.perf_counter() - start
        self._expected[header.request_id] = header.count
        self._done[header.request_id].add(header.seq)
        return spent

    def placement(self, request_id: str, arena: SharedArena) -> list[tuple[int, int]] | None:
        """(arena offset, bytes) of every layer of `request_id`, or None unless all live in `arena`."""
        regions = []
        for layer in self._bytes.get(request_id, ()):
            offset = arena.offset_of(layer)
            if offset is None:
                return None
            regions.append((offset, layer.numel()))
        return regions or None

    def delivered(self, request_id: str) -> int:
        return len(self._done.get(request_id, ()))

    def complete(self, request_id: str) -> bool:
        expected = self._expected.get(request_id)
        return expected is not None and len(self._done[request_id]) >= expected

    def invalidate(self, request_id: str) -> None:
        """Forget every delivered chunk of a failed transfer: none of its bytes may be used."""
        if request_id in self._done:
            self._done[request_id].clear()
            self._expected.pop(request_id, None)


class TransportEngine:
    def __init__(
        self,
        config: KVTransportConfig | None = None,
        hardware: HardwareProfile | None = None,
        *,
        telemetry: TransportTelemetry | None = None,
        max_retries: int = 2,
        granularity: str = "per_token",
    ) -> None:
        self.config = config or KVTransportConfig()
        self.planner = TransferPlanner(self.config, hardware)
        self.telemetry = telemetry or TransportTelemetry.default()
        self.max_retries = max_retries
        self.granularity = granularity

    # -- set-up ------------------------------------------------------------------

    def plan(self, request_id: str, layers: Sequence[torch.Tensor], **kw) -> tuple[TransportPlan, PlannedTransfer]:
        return self.planner.plan(request_id, layers, **kw)

    async def connect(self, address: str, *, backend: str | None = None) -> Connection:
        name = backend or address.split("://", 1)[0]
        # The shm ring holds at least two chunks, so one is copied in while the other is read out.
        options = {"ring_bytes": max(SHM_RING_BYTES, 2 * int(self.config.chunk_size))} if name == "shm" else {}
        channel = await get_backend(name, **options).connect(
            address, max_inflight=self.config.max_inflight, max_retries=self.max_retries,
            timeout_s=self.config.timeout_s,
        )  # fmt: skip
        return Connection(self, channel, address, name)

    async def listen(self, backend: str, address: str | None = None, *, arena: SharedArena | None = None) -> Listener:
        """Accept senders. With `arena` (shm only) senders write straight into destination
        buffers allocated from it (zero-copy receive)."""
        if arena is None:
            return await get_backend(backend).listen(address, max_retries=self.max_retries)
        if backend != "shm":
            raise TransportError(f"zero-copy receive into a shared arena needs the shm backend, not {backend}")
        return await get_backend(backend).listen(address, max_retries=self.max_retries, arena=arena)

    # -- sending -----------------------------------------------------------------

    def prepare_chunk(self, chunk: KVChunk, layer: torch.Tensor, plan: TransportPlan,
                      checksummed: bool = True) -> _Prepared:
        """Payload (converted if the plan says so) and CRC of one chunk."""
        raw = as_bytes(layer)[chunk.offset : chunk.offset + chunk.length]
        src = wire_name(layer.dtype)
        fields = dict(wire_dtype=src, src_dtype=src, raw_length=chunk.length)
        flags = Flag.LAST if chunk.is_last else Flag.NONE
        spent = 0.0
        if plan.converts and plan.wire_dtype.value != src:
            if src == "raw":
                raise ValueError(f"cannot convert {layer.dtype} KV to {plan.wire_dtype.value}")
            start = time.perf_counter()
            cols = layer.shape[-1]
            payload_t = converter.encode(raw.view(layer.dtype).view(-1, cols), plan.wire_dtype.value,
                                         self.granularity)
            spent = time.perf_counter() - start
            fields.update(wire_dtype=plan.wire_dtype.value, cols=cols, granularity=self.granularity)
            flags |= Flag.CONVERTED
        else:
            payload_t = raw
        payload = _host_view(payload_t)
        return _Prepared(fields, flags, payload, checksum(payload) if checksummed else 0, spent)

    async def send_prepared(
        self,
        conn: Connection,
        chunk: KVChunk,
        prepared: _Prepared,
        *,
        deadline: float,
        count: int = 1,
        stats: TransferStats | None = None,
    ) -> asyncio.Future:
        payload = prepared.payload
        header = ChunkHeader(
            Kind.DATA, chunk.request_id, seq=next(conn.seq), layer=chunk.layer, chunk_index=chunk.chunk_index,
            offset=chunk.offset, length=len(payload), count=count, flags=prepared.flags, crc=prepared.crc,
            **prepared.fields,
        )  # fmt: skip
        acked = await conn.channel.send(header, payload, deadline)
        self.telemetry.inflight.labels(conn.backend).set(conn.channel.inflight)
        if stats is not None:
            stats.chunks += 1
            stats.bytes += chunk.length
            stats.wire_bytes += len(payload)
            stats.convert_seconds += prepared.convert_seconds
        return acked

    async def send_kv_chunk(
        self,
        conn: Connection,
        chunk: KVChunk,
        layer: torch.Tensor,
        plan: TransportPlan,
        *,
        deadline: float,
        count: int = 1,
        stats: TransferStats | None = None,
    ) -> asyncio.Future:
        """Put one chunk on the wire (converted if the plan says so). Returns a future that
        resolves to the chunk's send→ACK seconds once the receiver verified it."""
        checksummed = not getattr(conn.channel, "computes_crc", False)
        prepared = self.prepare_chunk(chunk, layer, plan, checksummed)
        return await self.send_prepared(conn, chunk, prepared, deadline=deadline, count=count, stats=stats)

    async def stream_pipeline(
        self,
        conn: Connection,
        chunks: Sequence[KVChunk],
        plan: TransportPlan,
        layers: Sequence[torch.Tensor],
        *,
        priority: int = Priority.PREFILL,
        deadline_s: float | None = None,
        wait_placement: bool = False,
    ) -> TransferStats:
        """Send every chunk with up to `max_inflight` unacknowledged (shared by all transfers on
        `conn`; lower `priority` first); returns when all are verified at the receiver. Raises
        `TransportError` (and tells the receiver to drop the transfer) on any failure. With
        `wait_placement`, first wait for a zero-copy receiver to place the request."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_s if deadline_s is not None else plan.deadline_s)
        stats = TransferStats(plan.request_id, conn.backend, "send")
        start = loop.time()
        retransmits = conn.channel.retransmits
        if wait_placement:  # zero-copy: the receiver says where the KV goes before any byte moves
            what = f"waiting for the receiver to place {plan.request_id!r}"
            await before(conn.channel.wait_placed(plan.request_id), deadline, what)
        acks = [conn.submit(priority, deadline, chunk, layers[chunk.layer], plan, len(chunks), stats)
                for chunk in chunks]
        try:
            what = f"waiting for the receiver to verify {plan.request_id!r}"
            stats.chunk_seconds = list(await before(asyncio.gather(*acks), deadline, what))
        except TransportError as err:
            self.telemetry.failures.labels(err.reason).inc()
            await conn.channel.abort(plan.request_id, str(err))
            raise
        finally:
            for ack in acks:
                if not ack.done():
                    ack.cancel()
            self.telemetry.inflight.labels(conn.backend).set(conn.channel.inflight)
        stats.seconds = loop.time() - start
        stats.retransmits = conn.channel.retransmits - retransmits
        self._record(stats)
        return stats

    # -- receiving ---------------------------------------------------------------

    async def recv_kv_chunk(
        self, channel: RecvChannel, buffers: KVReceiveBuffers, *, deadline: float
    ) -> tuple[ChunkHeader, float] | None:
        """The next verified chunk, landed in `buffers` (and its decode seconds); None when
        the sender closed the connection."""
        header = await channel.recv(buffers.sink, deadline)
        if header is None:
            return None
        return header, buffers.land(header)

    async def receive(
        self,
        channel: RecvChannel,
        buffers: KVReceiveBuffers,
        request_ids: Iterable[str],
        *,
        deadline_s: float | None = None,
    ) -> dict[str, TransferStats]:
        """Receive until every listed request is complete. On failure every listed request
        that is not complete is invalidated (nothing of it counts as delivered)."""
        loop = asyncio.get_running_loop()
        wanted = list(request_ids)
        deadline = loop.time() + (deadline_s if deadline_s is not None else self.config.timeout_s)
        backend = channel.backend
        stats = {rid: TransferStats(rid, backend, "recv") for rid in wanted}
        started: dict[str, float] = {}
        try:
            if channel.arena is not None:
                for rid in wanted:
                    regions = buffers.placement(rid, channel.arena)
                    if regions is not None:
                        await before(channel.publish(rid, regions), deadline, f"placing {rid!r}")
            while not all(buffers.complete(rid) for rid in wanted):
                got = await self.recv_kv_chunk(channel, buffers, deadline=deadline)
                if got is None:
                    missing = [rid for rid in wanted if not buffers.complete(rid)]
                    raise PeerClosedError(f"{backend}: the sender closed the connection before {missing} completed")
                header, decode_s = got
                s = stats.get(header.request_id)
                if s is None:
                    continue  # another transfer on this channel; it is landed and tracked in buffers
                started.setdefault(header.request_id, loop.time())
                s.chunks += 1
                s.bytes += header.raw_length
                s.wire_bytes += header.length
                s.convert_seconds += decode_s
                if buffers.complete(header.request_id):
                    s.seconds = loop.time() - started[header.request_id]
        except TransportError as err:
            self.telemetry.failures.labels(err.reason).inc()
            for rid in wanted:
                if not buffers.complete(rid):
                    buffers.invalidate(rid)
            raise
        for s in stats.values():
            self._record(s)
        return stats

    def _record(self, stats: TransferStats) -> None:
        self.telemetry.bytes.labels(stats.backend, stats.direction).inc(stats.bytes)
        self.telemetry.seconds.labels(stats.backend, stats.direction).observe(stats.seconds)
