"""`KVPipe`: a request's prompt blocks from one engine's pool to another's, over the transport.

The engine runs on one synchronous thread; the transport engine is asyncio. The pipe
runs the transport on an event loop of its own (one thread) and gives the engine thread
non-blocking calls, in the shape of vLLM's KV-connector API:

- sending side (a prefill instance): ``start_send(transfer_id, address, rows, block_hashes)``
  queues the rows (``[n, block_nbytes]`` uint8, whole pool blocks in chain order) and their
  chained prefix-cache hashes for `address`;
  ``poll_sent()`` returns the transfers that ended since the last call, each verified by
  the receiver chunk by chunk (CRC32C) or failed with the reason;
- receiving side (a decode instance): ``address`` is where senders connect;
  ``expect(transfer_id, num_blocks, deadline_s)`` registers where the rows will land
  *before* anyone is asked to send them; ``poll_received()`` returns the transfers that
  completed (their rows and the sender's hashes) or failed (no rows: the request computes its
  prompt itself).

Blocks travel as opaque rows, "layer" 0 of the transfer, so whatever the pool stores (a KV
dtype, a layout) arrives bit-exact; "layer" 1 is the manifest: the blocks' 32-byte chained
hashes, in the same order, which the receiver checks against the hashes it computes for the
prompt before it registers a block under them. The plan's chunks name the source block ids
they carry (`KVChunk.block_ids`); the engines agree on the schema (its digest) and the
block count before a transfer is expected, and a transfer that does not fill exactly the
expected rows never completes. A late chunk of a transfer the receiver gave up
on lands in scratch memory and is dropped, so one failure never breaks the channel for the
next transfer. No pickle: the wire is the transport's fixed binary header plus raw bytes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from prometheus_client import CollectorRegistry

from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.interfaces.transport import TransportPlan
from sage_infer.prefix_reuse.hashing import HASH_BYTES
from sage_infer.transport.base import RecvChannel
from sage_infer.transport.buffers import KVReceiveBuffers
from sage_infer.transport.connection import Connection
from sage_infer.transport.engine import TransportEngine
from sage_infer.transport.telemetry import TransportTelemetry
from sage_infer.transport.transport_errors import TransportError
from sage_infer.transport.wire import ChunkHeader, Flag

log = logging.getLogger("sage_infer.kv_runtime")
IDLE_DEADLINE_S = 10**9  # a receive channel waits for its next chunk this long (transfers have their own)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """One transfer that ended: `rows` (receiving side, on success) or `error` (None: it worked)."""

    transfer_id: str
    rows: torch.Tensor | None = None
    error: str | None = None
    seconds: float = 0.0
    nbytes: int = 0
    block_hashes: tuple[bytes, ...] = ()  # receiving side: the sender's hash of each row

    @property
    def ok(self) -> bool:
        return self.error is None


class _DroppingBuffers(KVReceiveBuffers):
    """Receive buffers where a chunk of an unknown transfer (given up on, or never expected) lands in
    scratch memory instead of failing the channel that carries other transfers too."""

    def __init__(self) -> None:
        super().__init__()
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.dropped_chunks = 0
        self.mismatched: dict[str, str] = {}  # transfer id -> why its rows cannot be the ones expected

    def sink(self, header: ChunkHeader) -> memoryview:
        if header.request_id in self._bytes and not self._mismatch(header):
            return super().sink(header)
        self.dropped_chunks += 1
        if self._scratch.numel() < header.length:
            self._scratch = torch.empty(header.length, dtype=torch.uint8)
        return memoryview(self._scratch[: header.length].numpy())

    def land(self, header: ChunkHeader) -> float:
        if header.request_id not in self._bytes or header.request_id in self.mismatched:
            return 0.0
        return super().land(header)

    def _mismatch(self, header: ChunkHeader) -> bool:
        """The rows (layer 0) run past, or end short of, the rows registered for them: the sender's blocks
        have another size (another `kv_transport.target_dtype`); the transfer fails now, not at its deadline."""
        rid = header.request_id
        if rid in self.mismatched:
            return True
        expected = self._bytes[rid][0].numel()
        end = header.offset + header.length
        if header.layer != 0 or (end <= expected and not (header.flags & Flag.LAST and end < expected)):
            return False
        self.mismatched[rid] = (f"the sender's KV rows do not fill the {expected} bytes this worker expects (a "
                                f"chunk ends at byte {end}): both workers must set the same kv_transport.target_dtype")
        return True


@dataclass(slots=True)
class _Expected:
    rows: torch.Tensor  # [n, block_nbytes] uint8, where the transfer lands
    manifest: torch.Tensor  # [n, HASH_BYTES] uint8, the rows' hashes
    deadline: float  # loop time
    started: float


class KVPipe:
    """Send and/or receive whole KV blocks; one event-loop thread, any number of peers."""

    def __init__(self, schema: KVCacheSchema, config: KVTransportConfig | None = None, *, backend: str = "shm",
                 listen: bool = False, listen_address: str | None = None) -> None:
        self.schema = schema
        self.block_nbytes = schema.bytes_per_block
        self.config = config or KVTransportConfig()
        self.backend = backend
        # the transport's own metrics (chunks in flight, failures by reason, bytes and seconds per backend) on a
        # registry of this pipe's, which the server's /metrics serves next to its own
        self.telemetry = TransportTelemetry(CollectorRegistry())
        self.transport = TransportEngine(self.config, telemetry=self.telemetry)
        self.address: str | None = None
        self._buffers = _DroppingBuffers()
        self._expected: dict[str, _Expected] = {}
        self._conns: dict[str, Connection] = {}
        # one connect per address at a time: sends started together share one connection, instead of
        # each opening its own and all but the last leaking (never closed)
        self._connecting: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._sent = _Results(self)
        self._received = _Results(self)
        self.on_result: Callable[[], None] | None = None  # called on the loop thread whenever a transfer ends
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sage-kv-pipe", daemon=True)
        self._thread.start()
        self._listener = None
        if listen:
            self._call(self._listen(listen_address))

    # -- the engine thread's calls (non-blocking, or a few microseconds on the loop) ---------------

    def start_send(self, transfer_id: str, address: str, rows: torch.Tensor, block_hashes: Sequence[bytes],
                   block_ids: Sequence[int] = (), schema: KVCacheSchema | None = None) -> None:
        """Send `rows` (``[n, block_nbytes]`` uint8) and their `block_hashes` (n chained prefix-cache hashes) to
        the receiver at `address`; `block_ids` (the source blocks, for the plan) optional. `schema`: the rows'
        format when they were converted for the receiver (default: this pipe's). See `poll_sent`."""
        schema = schema or self.schema
        rows = rows.contiguous().view(torch.uint8).reshape(-1, schema.bytes_per_block)
        if len(block_hashes) != rows.shape[0] or any(len(h) != HASH_BYTES for h in block_hashes):
            raise ValueError(f"{rows.shape[0]} rows need as many {HASH_BYTES}-byte hashes, got {len(block_hashes)}")
        manifest = torch.frombuffer(bytearray(b"".join(block_hashes)), dtype=torch.uint8)
        asyncio.run_coroutine_threadsafe(self._send(transfer_id, address, rows, manifest, tuple(block_ids), schema),
                                         self._loop)

    def poll_sent(self) -> list[TransferResult]:
        return _drain(self._sent)

    def expect(self, transfer_id: str, num_blocks: int, deadline_s: float | None = None) -> None:
        """Register where `transfer_id`'s `num_blocks` rows land; call it before asking a sender to send."""
        if self._listener is None:
            raise RuntimeError("this pipe does not receive (listen=False)")
        if num_blocks <= 0:
            raise ValueError(f"a transfer carries at least one block, got {num_blocks}")
        timeout = deadline_s if deadline_s is not None else self.config.timeout_s
        self._call(self._expect(transfer_id, num_blocks, timeout))

    def cancel(self, transfer_id: str) -> None:
        """Stop waiting for `transfer_id` (its request ended); late chunks are dropped."""
        self._call(self._forget(transfer_id))

    def poll_received(self) -> list[TransferResult]:
        return _drain(self._received)

    @property
    def dropped_chunks(self) -> int:
        return self._buffers.dropped_chunks

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._aclose(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- on the loop -------------------------------------------------------------------------------

    async def _listen(self, address: str | None) -> None:
        self._listener = await self.transport.listen(self.backend, address)
        self.address = self._listener.address
        self._spawn(self._accept_loop())
        self._spawn(self._expire_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                channel = await self._listener.accept(loop.time() + IDLE_DEADLINE_S)
            except TransportError as err:
                log.warning("KV pipe: accept failed: %s", err)
                await asyncio.sleep(0.05)
                continue
            self._spawn(self._receive_loop(channel))

    async def _receive_loop(self, channel: RecvChannel) -> None:
        """Land chunks from one sender until it hangs up (or its channel breaks)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                got = await self.transport.recv_kv_chunk(channel, self._buffers, deadline=loop.time() + IDLE_DEADLINE_S)
                if got is None:
                    return
                header, _ = got
                rid = header.request_id
                why = self._buffers.mismatched.pop(rid, None)
                if why is not None and rid in self._expected:
                    self._expected.pop(rid)
                    self._buffers.release(rid)
                    self._received.append(TransferResult(rid, None, why))
                elif rid in self._expected and self._buffers.complete(rid):
                    entry = self._expected.pop(rid)
                    self._buffers.release(rid)
                    hashes = entry.manifest.numpy().tobytes()
                    self._received.append(TransferResult(
                        rid, entry.rows, None, loop.time() - entry.started, entry.rows.numel() + len(hashes),
                        tuple(hashes[i : i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES))))
        except TransportError as err:  # the channel is done; transfers on it fail at their deadline or now
            log.warning("KV pipe: receive channel closed: %s", err)
        finally:
            await channel.aclose()

    async def _expect(self, transfer_id: str, num_blocks: int, timeout: float) -> None:
        if transfer_id in self._expected:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        rows = torch.empty((num_blocks, self.block_nbytes), dtype=torch.uint8)
        manifest = torch.empty((num_blocks, HASH_BYTES), dtype=torch.uint8)
        now = asyncio.get_running_loop().time()
        self._expected[transfer_id] = _Expected(rows, manifest, now + timeout, now)
        self._buffers.register(transfer_id, [rows.reshape(-1), manifest.reshape(-1)])

    async def _forget(self, transfer_id: str) -> None:
        if self._expected.pop(transfer_id, None) is not None:
            self._buffers.release(transfer_id)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.05)
            now = loop.time()
            for rid in [rid for rid, e in self._expected.items() if now >= e.deadline]:
                entry = self._expected.pop(rid)
                self._buffers.release(rid)
                self._received.append(TransferResult(rid, None, f"no KV arrived within the deadline "
                                                               f"({now - entry.started:.1f} s)"))

    async def _send(self, transfer_id: str, address: str, rows: torch.Tensor, manifest: torch.Tensor,
                    block_ids: tuple[int, ...], schema: KVCacheSchema) -> None:
        start = time.perf_counter()
        try:
            async with self._connecting[address]:
                conn = self._conns.get(address)
                if conn is None:
                    conn = self._conns[address] = await self.transport.connect(address, backend=self.backend)
            plan = self._plan(transfer_id, address, rows.shape[0], manifest.numel(), block_ids, schema)
            stats = await self.transport.stream_pipeline(conn, plan.chunks, plan, [rows.reshape(-1), manifest])
        except (TransportError, OSError, ValueError) as err:
            stale = self._conns.pop(address, None)
            if stale is not None:
                await _close_quietly(stale)
            self._sent.append(TransferResult(transfer_id, None, str(err) or type(err).__name__,
                                             time.perf_counter() - start))
            return
        self._sent.append(TransferResult(transfer_id, None, None, stats.seconds, stats.bytes))

    def _plan(self, transfer_id: str, address: str, num_rows: int, manifest_nbytes: int,
              block_ids: tuple[int, ...], schema: KVCacheSchema) -> TransportPlan:
        """Chunks of whole blocks (layer 0, each naming its source block ids when known), then the manifest."""
        block_nbytes = schema.bytes_per_block
        per_chunk = max(1, int(self.config.chunk_size) // block_nbytes)
        dtype = schema.dtype
        rows = TransportPlan.split(transfer_id, 0, num_rows * block_nbytes, per_chunk * block_nbytes, dtype)
        if block_ids:
            rows = [replace(c, block_ids=block_ids[i * per_chunk : (i + 1) * per_chunk]) for i, c in enumerate(rows)]
        manifest = TransportPlan.split(transfer_id, 1, manifest_nbytes, manifest_nbytes, dtype)
        return TransportPlan(transfer_id, "local", address, self.backend, schema, dtype, (*rows, *manifest),
                             deadline_s=self.config.timeout_s)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self._conns.values()):
            await _close_quietly(conn)
        self._conns.clear()
        if self._listener is not None:
            await self._listener.aclose()


async def _close_quietly(conn: Connection) -> None:
    try:
        await conn.aclose()
    except (TransportError, OSError):
        pass


class _Results(collections.deque):
    """Finished transfers, appended on the loop thread; `on_result` wakes an engine waiting for them."""

    def __init__(self, owner: KVPipe) -> None:
        super().__init__()
        self.owner = owner

    def append(self, result: TransferResult) -> None:
        super().append(result)
        if self.owner.on_result is not None:
            self.owner.on_result()


def _drain(queue: collections.deque) -> list:
    out = []
    while queue:
        out.append(queue.popleft())
    return out
