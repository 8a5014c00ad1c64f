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
import time
from collections.abc import Iterable, Sequence

import torch

from sage_infer.config.hardware import HardwareProfile
from sage_infer.config.transport import KVTransportConfig
from sage_infer.interfaces.transport import KVChunk, TransportPlan
from sage_infer.transport.arena import SharedArena
from sage_infer.transport.base import Listener, RecvChannel, before, get_backend
from sage_infer.transport.buffers import KVReceiveBuffers, as_bytes, host_view
from sage_infer.transport.connection import Connection
from sage_infer.transport.format import converter
from sage_infer.transport.planner import PlannedTransfer, TransferPlanner, wire_name
from sage_infer.transport.stats import Priority, TransferRecord
from sage_infer.transport.telemetry import TransportTelemetry
from sage_infer.transport.transport_errors import (
    AuthError,
    PeerClosedError,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from sage_infer.transport.wire import Checksum, ChunkHeader, Flag, Kind, checksum

CHECKSUMS = {"crc32c": Checksum.CRC32C, "none": Checksum.NONE}

SHM_RING_BYTES = 8 * 1024 * 1024  # small enough to stay in the last-level cache (measured best of 4-32 MiB)


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
        """A connection to the listener at `address`; with `kv_transport.auth_token` (shm, tcp) it first
        proves it holds the token and checks that the listener does (`AuthError` otherwise)."""
        name = backend or address.split("://", 1)[0]
        # The shm ring holds at least two chunks, so one is copied in while the other is read out.
        options = {"ring_bytes": max(SHM_RING_BYTES, 2 * int(self.config.chunk_size))} if name == "shm" else {}
        peer = get_backend(name, **options)
        auth = {"token": self._token()} if peer.authenticates else {}
        try:
            channel = await peer.connect(
                address, max_inflight=self.config.max_inflight, max_retries=self.max_retries,
                timeout_s=self.config.timeout_s, **auth,
            )  # fmt: skip
        except AuthError as err:
            self.telemetry.failures.labels(err.reason).inc()
            raise
        return Connection(self, channel, address, name)

    async def listen(self, backend: str, address: str | None = None, *, arena: SharedArena | None = None) -> Listener:
        """Accept senders. With `kv_transport.auth_token` (shm, tcp) only senders that prove they
        hold it; every connection turned away is logged and counted in the failures metric. With
        `arena` (shm only) senders write straight into destination buffers allocated from it
        (zero-copy receive)."""
        if arena is not None and backend != "shm":
            raise TransportError(f"zero-copy receive into a shared arena needs the shm backend, not {backend}")
        peer = get_backend(backend)
        options = {"arena": arena} if arena is not None else {}
        if peer.authenticates:
            options.update(token=self._token(), setup_timeout_s=self.config.timeout_s, on_refused=self._refused)
        return await peer.listen(address, max_retries=self.max_retries, **options)

    def _token(self) -> bytes | None:
        token = self.config.auth_token
        return token.get_secret_value().encode() if token is not None else None

    def _refused(self, err: TransportError) -> None:
        self.telemetry.failures.labels(err.reason).inc()

    # -- sending -----------------------------------------------------------------

    async def send_kv_chunk(
        self,
        conn: Connection,
        chunk: KVChunk,
        layer: torch.Tensor,
        plan: TransportPlan,
        *,
        deadline: float,
        count: int = 1,
        stats: TransferRecord | None = None,
        source: memoryview | None = None,
        acked: asyncio.Future | None = None,
        ack_now: bool = True,
    ) -> asyncio.Future:
        """Put one chunk on the wire (converted if the plan says so). Returns a future (`acked`, when
        given) that resolves to the chunk's send→ACK seconds once the receiver verified it. `source`:
        the layer's bytes as a host view, made once per transfer (else taken from `layer` per chunk).
        `ack_now=False` lets the receiver acknowledge this chunk together with the next ones (more follow)."""
        src = wire_name(layer.dtype)
        flags = Flag.LAST if chunk.is_last else Flag.NONE
        if ack_now:
            flags |= Flag.ACK_NOW
        convert_seconds = 0.0
        pending = None
        wire, cols, granularity = src, 0, "per_token"
        algorithm = CHECKSUMS[self.config.checksum]
        crc = None  # computed here (fused into the conversion) or by the channel as it stages the payload
        if plan.converts and plan.wire_dtype.value != src:
            if src == "raw":
                raise ValueError(f"cannot convert {layer.dtype} KV to {plan.wire_dtype.value}")
            start = time.perf_counter()
            raw = as_bytes(layer)[chunk.offset : chunk.offset + chunk.length]
            wire, cols, granularity = plan.wire_dtype.value, layer.shape[-1], self.granularity
            x = raw.view(layer.dtype).view(-1, cols)
            in_place = conn.channel.encodes_in_place and x.device.type == "cpu" and not converter.is_lossless(wire)
            if in_place and algorithm is not Checksum.CRC32:
                payload = pending = converter.PendingEncode(x, wire, granularity)  # encoded where it is staged
            elif algorithm is Checksum.CRC32C and not conn.channel.computes_crc and x.device.type == "cpu":
                encoded, crc = converter.encode_checksummed(x, wire, granularity)  # one pass: codes and CRC
                payload = host_view(encoded)
            else:
                payload = host_view(converter.encode(x, wire, granularity))
            convert_seconds = time.perf_counter() - start
            flags |= Flag.CONVERTED
        elif source is not None:
            payload = source[chunk.offset : chunk.offset + chunk.length]
        else:
            payload = host_view(as_bytes(layer)[chunk.offset : chunk.offset + chunk.length])
        if crc is None:
            crc = 0 if conn.channel.computes_crc or pending is not None else checksum(payload, algorithm)
        header = ChunkHeader(
            Kind.DATA, chunk.request_id, seq=next(conn.seq), layer=chunk.layer, chunk_index=chunk.chunk_index,
            offset=chunk.offset, length=len(payload), raw_length=chunk.length, count=count, flags=flags,
            wire_dtype=wire, src_dtype=src, granularity=granularity, cols=cols, crc=crc, algorithm=algorithm,
        )  # fmt: skip
        acked = await conn.channel.send(header, payload, deadline, acked)
        if pending is not None:
            convert_seconds += pending.seconds
        conn.inflight_gauge.set(conn.channel.inflight)
        if stats is not None:
            stats.chunks += 1
            stats.bytes += chunk.length
            stats.wire_bytes += len(payload)
            stats.convert_seconds += convert_seconds
        return acked

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
    ) -> TransferRecord:
        """Send every chunk with up to `max_inflight` unacknowledged (shared by all transfers on
        `conn`; lower `priority` first); returns when all are verified at the receiver. Raises
        `TransportError` (and tells the receiver to drop the transfer) on any failure. With
        `wait_placement`, first wait for a zero-copy receiver to place the request."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (deadline_s if deadline_s is not None else plan.deadline_s)
        stats = TransferRecord(plan.request_id, conn.backend, "send")
        start = loop.time()
        retransmits = conn.channel.retransmits
        if wait_placement:  # zero-copy: the receiver says where the KV goes before any byte moves
            what = f"waiting for the receiver to place {plan.request_id!r}"
            await before(conn.channel.wait_placed(plan.request_id), deadline, what)
        sources = _host_sources(layers, plan)
        acks = [conn.submit(priority, deadline, chunk, layers[chunk.layer], plan, len(chunks), stats,
                            sources[chunk.layer]) for chunk in chunks]
        try:
            what = f"waiting for the receiver to verify {plan.request_id!r}"
            stats.chunk_seconds = list(await before(asyncio.gather(*acks), deadline, what))
        except TransportError as err:
            self.telemetry.failures.labels(err.reason).inc()
            await conn.channel.abort(plan.request_id, str(err))
            if isinstance(err, TransferTimeout):
                # Its chunks still hold in-flight slots that no ACK will free: the connection
                # is unusable, and later transfers on it fail at once instead of stalling.
                conn.channel.fail(err)
            raise
        finally:
            for ack in acks:
                if not ack.done():
                    ack.cancel()
            conn.inflight_gauge.set(conn.channel.inflight)
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
        if channel.decodes_in_place:
            header = await channel.recv(buffers.sink, deadline, decoder=buffers.decode_from)
        else:
            header = await channel.recv(buffers.sink, deadline)
        if header is None:
            return None
        if header.algorithm is Checksum.NONE and self.config.checksum != "none":
            raise ProtocolError(f"{channel.backend}: the sender sends chunks without a checksum; this receiver "
                                "requires one (set kv_transport.checksum=none on both ends to trust the link)")
        return header, buffers.land(header)

    async def receive(
        self,
        channel: RecvChannel,
        buffers: KVReceiveBuffers,
        request_ids: Iterable[str],
        *,
        deadline_s: float | None = None,
    ) -> dict[str, TransferRecord]:
        """Receive until every listed request is complete. On failure every listed request
        that is not complete is invalidated (nothing of it counts as delivered)."""
        loop = asyncio.get_running_loop()
        wanted = list(request_ids)
        deadline = loop.time() + (deadline_s if deadline_s is not None else self.config.timeout_s)
        backend = channel.backend
        stats = {rid: TransferRecord(rid, backend, "recv") for rid in wanted}
        started: dict[str, float] = {}
        try:
            if channel.arena is not None:
                for rid in wanted:
                    regions = buffers.placement(rid, channel.arena)
                    if regions is not None:
                        await before(channel.publish(rid, regions), deadline, f"placing {rid!r}")
            incomplete = {rid for rid in wanted if not buffers.complete(rid)}  # (only their own chunks complete them)
            while incomplete:
                got = await self.recv_kv_chunk(channel, buffers, deadline=deadline)
                if got is None:
                    missing = [rid for rid in wanted if rid in incomplete]
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
                if header.request_id in incomplete and buffers.complete(header.request_id):
                    s.seconds = loop.time() - started[header.request_id]
                    incomplete.discard(header.request_id)
        except TransportError as err:
            self.telemetry.failures.labels(err.reason).inc()
            for rid in wanted:
                if not buffers.complete(rid):
                    buffers.invalidate(rid)
            raise
        for s in stats.values():
            self._record(s)
        return stats

    def _record(self, stats: TransferRecord) -> None:
        self.telemetry.bytes.labels(stats.backend, stats.direction).inc(stats.bytes)
        self.telemetry.seconds.labels(stats.backend, stats.direction).observe(stats.seconds)


def _host_sources(layers: Sequence[torch.Tensor], plan: TransportPlan) -> list[memoryview | None]:
    """Each host layer's bytes as one view, made once per transfer so chunks are slices of it (None:
    the chunk is made per chunk — a device layer is staged through the host chunk by chunk, a
    converted one is encoded)."""
    if plan.converts:
        return [None] * len(layers)
    return [host_view(as_bytes(t)) if t.device.type == "cpu" else None for t in layers]
