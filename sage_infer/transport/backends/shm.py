"""`shm`: KV between processes on one host through a reused shared-memory ring.

The sender creates one anonymous shared-memory file per connection (`memfd_create`),
sizes and pre-faults it once — first-touch page faults make fresh allocations many
times slower, so nothing is allocated per transfer — and hands the file descriptor to
the receiver over a Unix socket (SCM_RIGHTS). No name exists in /dev/shm, so a crash
leaks nothing and no other process can open the ring.

The listener opens every connection (auth.py: the shared-token challenge when it has one)
before it takes the ring, so an unauthenticated peer never maps a receiver's arena.

Per chunk: the sender copies the payload into a free region of the ring with its CRC32C
in the same pass, and sends the 128-byte header (region offset in `slot`) over the Unix socket.
A converted chunk is encoded straight into the ring instead (`converter.PendingEncode`: codes,
scales and their CRC in one pass over the source). The receiver (shm_recv.py) copies the region
into the buffer its sink registered (or decodes a converted chunk from the ring into its
destination), taking the CRC in that pass, checks it, and answers ACK (the region is reused;
one ACK may cover a run of chunks) or NACK (the sender copies or encodes the chunk again from
its still-registered source). The socket is the only synchronisation (each send/recv is a
full barrier), and its EOF is how a dead peer is noticed at once.

Zero-copy: a receiver listening with a `SharedArena` hands its descriptor to the sender
in the HELLO reply and, per request, PLACEs where each layer's destination lies in it.
The sender then copies chunks of placed requests straight into the destination (flag
DIRECT, arena offset in `slot`) and the receiver only verifies the CRC in place.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from sage_infer.quantization.kv_codec_kernel import ArrayCopy, array_copier
from sage_infer.transport.accept import AcceptingListener, OnRefused
from sage_infer.transport.arena import SharedArena
from sage_infer.transport.auth import answer_challenge, socket_io
from sage_infer.transport.backends.shm_recv import ShmRecvChannel, recv_exactly
from sage_infer.transport.base import Backend, SendChannel, before, register_backend
from sage_infer.transport.format.converter import PendingEncode
from sage_infer.transport.transport_errors import (
    PeerClosedError,
    ProtocolError,
    TransportError,
    TruncatedError,
)
from sage_infer.transport.wire import HEADER_BYTES, Checksum, ChunkHeader, Flag, Kind, checksum

DEFAULT_RING_BYTES = 8 * 1024 * 1024
SCHEME = "shm://"
MAX_PLACED_LAYERS = 4096  # a PLACE lists (offset, bytes) per layer: 16 bytes each


async def read_header(sock: socket.socket, buf: bytearray, what: str) -> ChunkHeader | None:
    """One header, or None on a clean EOF before its first byte."""
    got = await recv_exactly(sock, memoryview(buf))
    if got == 0:
        return None
    if got < HEADER_BYTES:
        raise TruncatedError(f"shm: stream ended inside a header ({got}/{HEADER_BYTES} bytes) while {what}")
    return ChunkHeader.unpack(buf)


PIECE = 256 * 1024  # copy, then checksum while the piece is still in L2
# How the sender's one-pass copy stores (kv_codec_kernel.array_copier): streaming from 1 MiB, into the ring
# too. Plain stores into the ring (so the receiver would read it from cache) cost the sender 120-129 µs of CPU per
# 1 MiB chunk against 105-106 streamed, and the receiver, reading from another core, gained nothing (100-103 µs)
RING_STREAM = -1
DIRECT_STREAM = -1


def copy_piece(dest: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dest, src)


def copy_and_checksum(dest: np.ndarray, payload: memoryview | PendingEncode, algorithm, stream: int = -1,
                      fused: ArrayCopy | None = None) -> int:
    """Copy `payload` into `dest` and checksum it: a CRC32C in one pass with the copy (`fused`, the kernel's
    `kv_codec_kernel.array_copier`, where it loads), else piece by piece, checksumming each piece of the *source*
    right after (it is still in L2). A `PendingEncode` is encoded into `dest` instead, its CRC32C taken in the same
    pass. The receiver checks its bytes against this CRC, so a bad copy on either side is caught."""
    if isinstance(payload, PendingEncode):  # (the engine sends no CRC32 chunk this way)
        return payload.write(torch.from_numpy(dest), algorithm is Checksum.CRC32C)
    src = np.frombuffer(payload, dtype=np.uint8)
    if algorithm is Checksum.NONE:  # one copy, nothing to interleave
        copy_piece(dest, src)
        return 0
    if algorithm is Checksum.CRC32C and fused is not None:  # one pass: each byte loaded once, copied and checksummed
        return fused(dest, src, 0, stream)
    crc = 0
    for start in range(0, len(src), PIECE):
        piece = src[start : start + PIECE]
        copy_piece(dest[start : start + PIECE], piece)
        crc = checksum(piece, algorithm, crc)
    return crc


class _Regions:
    """Allocator of contiguous byte regions in a ring, freed in any order, reused in FIFO order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: deque[list] = deque()  # [start, end, freed]
        self._by_start: dict[int, list] = {}
        self._tail = 0

    def fits(self, n: int) -> bool:
        """Whether `alloc(n)` would succeed now."""
        return self._start_for(n) is not None

    def alloc(self, n: int) -> int | None:
        start = self._start_for(n)
        if start is None:
            return None
        region = [start, start + n, False]
        self._live.append(region)
        self._by_start[start] = region
        self._tail = start + n
        return start

    def _start_for(self, n: int) -> int | None:
        if not self._live:
            start = 0 if n <= self.size else None
        else:
            head = self._live[0][0]
            if self._live[-1][0] < head:  # wrapped: free space is [tail, head)
                start = self._tail if self._tail + n <= head else None
            else:  # free space is [tail, size) and [0, head)
                start = self._tail if self._tail + n <= self.size else (0 if n <= head else None)
        return start

    def free(self, start: int) -> None:
        region = self._by_start.pop(start, None)
        if region is None:
            return
        region[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()


class ShmSendChannel(SendChannel):
    backend = "shm"
    computes_crc = True
    encodes_in_place = True

    def __init__(self, sock: socket.socket, ring: SharedArena, peer_arena: SharedArena | None = None,
                 **kw) -> None:
        super().__init__(**kw)
        self._sock = sock
        self._ring = ring
        self.peer_arena = peer_arena
        self._placements: dict[str, np.ndarray] = {}  # request -> [layers, 2] (arena offset, bytes)
        self._placed: dict[str, asyncio.Event] = {}
        self._ring_np = ring.array
        self._regions = _Regions(ring.nbytes)
        self._region_of: dict[int, int] = {}
        self._largest = 0  # the largest chunk staged in the ring so far
        self._fused = array_copier()  # the one-pass copy + CRC32C, chosen once for the connection
        self._space = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read_control())

    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        if header.kind is not Kind.DATA:
            await self._send(header.pack(), deadline)
            return
        flags = header.flags
        if len(self._pending) >= self.max_inflight or flags & Flag.RETRY:  # we wait for ACKs next
            flags |= Flag.ACK_NOW
        place = self._placements.get(header.request_id)
        if place is not None and not flags & Flag.CONVERTED:
            packed = self._stage_direct(header, payload, place, flags)
        else:
            packed = await self._stage_in_ring(header, payload, deadline, flags)
        await self._send(packed, deadline)

    async def _stage_in_ring(self, header: ChunkHeader, payload: memoryview, deadline: float, flags: Flag) -> bytes:
        """Copy (and checksum) the payload into a free region of the ring; returns its packed header."""
        n = len(payload)
        if n > self._regions.size:
            raise TransportError(f"shm: a {n}-byte chunk does not fit the {self._regions.size}-byte ring")
        start = self._region_of.get(header.seq) if header.flags & Flag.RETRY else None
        while start is None:
            self._raise_if_failed()
            start = self._regions.alloc(n)
            if start is None:
                self._space.clear()
                await before(self._space.wait(), deadline, "waiting for room in the shm ring (receiver behind)")
        self._region_of[header.seq] = start
        crc = copy_and_checksum(self._ring_np[start : start + n], payload, header.algorithm, RING_STREAM, self._fused)
        self._largest = max(self._largest, n)
        if not self._regions.fits(self._largest):  # the next chunk may wait for room: regions must come back
            flags |= Flag.ACK_NOW
        return header.pack(slot=start, crc=crc, flags=flags)

    def _stage_direct(self, header: ChunkHeader, payload: memoryview, place: np.ndarray, flags: Flag) -> bytes:
        """Copy (and checksum) the payload straight into the receiver's placed buffer; its packed header."""
        n = len(payload)
        if header.layer >= len(place) or header.offset + n > place[header.layer, 1]:
            raise ProtocolError(
                f"shm: chunk {header.chunk_index} of layer {header.layer} falls outside the buffer the receiver placed"
            )
        start = int(place[header.layer, 0]) + header.offset
        crc = copy_and_checksum(self.peer_arena.array[start : start + n], payload, header.algorithm, DIRECT_STREAM,
                                self._fused)
        return header.pack(slot=start, crc=crc, flags=flags | Flag.DIRECT)

    async def _send(self, data: bytes, deadline: float) -> None:
        """Write a message on the control socket; only a full socket buffer makes it wait (until `deadline`)."""
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            rest = memoryview(data)[sent:]
            await before(self._loop.sock_sendall(self._sock, rest), deadline, "sending (the receiver reads nothing)")

    def _acked(self, seq: int) -> None:
        start = self._region_of.pop(seq, None)
        if start is not None:
            self._regions.free(start)
            self._space.set()

    def _fail(self, err: TransportError) -> None:
        super()._fail(err)
        if hasattr(self, "_space"):
            self._space.set()

    async def _read_control(self) -> None:
        buf = bytearray(HEADER_BYTES)
        try:
            while True:
                msg = await read_header(self._sock, buf, "waiting for acknowledgements")
                if msg is None:
                    self._on_lost("connection closed")
                    return
                if msg.kind is Kind.PLACE:
                    if msg.length != 16 * msg.count or msg.count > MAX_PLACED_LAYERS:
                        raise ProtocolError(f"shm: malformed PLACE for {msg.request_id!r} ({msg.length} bytes)")
                    self._on_place(msg, await self._read_payload(msg.length))
                    continue
                self._on_control(msg)
        except (OSError, TransportError) as err:
            self._on_lost(str(err))

    async def _read_payload(self, n: int) -> bytearray:
        data = bytearray(n)
        if await recv_exactly(self._sock, memoryview(data)) != n:
            raise TruncatedError("shm: stream ended inside a PLACE message")
        return data

    def _on_place(self, msg: ChunkHeader, data: bytearray) -> None:
        if self.peer_arena is None:
            raise ProtocolError("shm: the receiver placed buffers but shared no arena")
        place = np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.int64)
        if (place[:, 0] + place[:, 1] > self.peer_arena.nbytes).any():
            raise ProtocolError(f"shm: placement of {msg.request_id!r} lies outside the receiver's arena")
        self._placements[msg.request_id] = place
        self._placed.setdefault(msg.request_id, asyncio.Event()).set()

    async def wait_placed(self, request_id: str) -> None:
        if self.peer_arena is not None and request_id not in self._placements:
            await self._placed.setdefault(request_id, asyncio.Event()).wait()

    async def _close(self) -> None:
        self._reader.cancel()
        self._sock.close()
        if self.peer_arena is not None:
            self.peer_arena.close()
        del self._ring_np
        self._ring.close()


class ShmListener(AcceptingListener):
    def __init__(self, server: socket.socket, path: str, max_retries: int, arena: SharedArena | None,
                 **kw) -> None:
        self._path = path
        self._max_retries = max_retries
        self._arena = arena
        super().__init__(server, SCHEME + path, **kw)

    def _peer_of(self, sock: socket.socket) -> str:
        try:
            pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except (OSError, AttributeError):  # no SO_PEERCRED off Linux
            return "a local process"
        return f"pid {pid}"

    async def _set_up(self, sock: socket.socket, deadline: float) -> ShmRecvChannel:
        """Take the sender's ring (HELLO + its fd) and answer, with our arena's fd when zero-copy."""
        loop = asyncio.get_running_loop()
        sock.setblocking(True)
        sock.settimeout(max(0.1, deadline - loop.time()))
        try:
            msg, fds, _, _ = await asyncio.to_thread(socket.recv_fds, sock, HEADER_BYTES, 1)
        except TimeoutError:
            raise PeerClosedError("shm: the sender connected but sent no ring") from None
        if len(msg) != HEADER_BYTES or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ProtocolError("shm: the connection did not go on with a HELLO carrying the ring")
        try:
            hello = ChunkHeader.unpack(msg)
        except TransportError:
            os.close(fds[0])
            raise
        ring = SharedArena(hello.length, fd=fds[0])  # the sender's ring; the arena owns the fd now
        try:
            if self._arena is not None:  # zero-copy: the sender maps our arena
                reply = replace(hello.reply(Kind.HELLO), length=self._arena.nbytes, flags=Flag.DIRECT)
                await asyncio.to_thread(socket.send_fds, sock, [reply.pack()], [self._arena.fd])
            else:
                sock.sendall(hello.reply(Kind.HELLO).pack())
        except OSError as err:
            ring.close()
            raise PeerClosedError(f"shm: the sender went away during set-up ({err})") from None
        sock.setblocking(False)
        return ShmRecvChannel(sock, ring, self._arena, max_retries=self._max_retries)

    async def aclose(self) -> None:
        await super().aclose()
        try:
            os.unlink(self._path)
            os.rmdir(os.path.dirname(self._path))
        except OSError:
            pass


@register_backend
class ShmBackend(Backend):
    name = "shm"
    description = "shared-memory ring between processes on one host (Unix socket for control)"
    authenticates = True

    def __init__(self, ring_bytes: int = DEFAULT_RING_BYTES) -> None:
        self.ring_bytes = ring_bytes  # the engine sizes it to hold at least two chunks

    async def listen(
        self, address: str | None = None, *, max_retries: int = 2, arena: SharedArena | None = None,
        token: bytes | None = None, setup_timeout_s: float = 30.0, on_refused: OnRefused | None = None,
    ) -> ShmListener:
        """`token`: connections must pass the shared-token handshake (auth.py); `setup_timeout_s` bounds
        each connection's handshake and set-up; `on_refused` hears of every connection turned away."""
        if address is None:
            path = os.path.join(tempfile.mkdtemp(prefix="sage-shm-"), "ctl.sock")  # mkdtemp: mode 0700
        else:
            path = _path_of(address)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(16)
        server.setblocking(False)
        return ShmListener(server, path, max_retries, arena, token=token, setup_timeout_s=setup_timeout_s,
                           on_refused=on_refused)

    async def connect(
        self, address: str, *, max_inflight: int = 8, max_retries: int = 2, timeout_s: float = 30.0,
        token: bytes | None = None,
    ) -> ShmSendChannel:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await before(loop.sock_connect(sock, _path_of(address)), deadline, f"connecting to {address}")
            await before(answer_challenge(*socket_io(sock), token, f"shm: {address}"), deadline,
                         f"opening the connection to {address}")
        except OSError as err:
            sock.close()
            raise PeerClosedError(f"shm: cannot connect to {address}: {err.strerror or err}") from None
        except BaseException:
            sock.close()
            raise
        ring = SharedArena(self.ring_bytes)  # pre-faulted once: nothing is allocated per transfer
        hello = ChunkHeader(Kind.HELLO, "ring", length=self.ring_bytes)
        try:
            sock.setblocking(True)
            sock.settimeout(max(0.1, deadline - loop.time()))
            await asyncio.to_thread(socket.send_fds, sock, [hello.pack()], [ring.fd])
            msg, fds, _, _ = await asyncio.to_thread(socket.recv_fds, sock, HEADER_BYTES, 1)
            if 0 < len(msg) < HEADER_BYTES:
                msg += await asyncio.to_thread(sock.recv, HEADER_BYTES - len(msg), socket.MSG_WAITALL)
            sock.setblocking(False)
        except (OSError, TransportError) as err:
            sock.close()
            ring.close()
            raise PeerClosedError(f"shm: set-up with {address} failed ({err})") from None
        reply = ChunkHeader.unpack(msg) if len(msg) == HEADER_BYTES else None
        if reply is None or reply.kind is not Kind.HELLO:
            sock.close()
            ring.close()
            for extra in fds:
                os.close(extra)
            raise PeerClosedError(f"shm: {address} closed the connection during set-up")
        peer_arena = SharedArena(reply.length, fd=fds[0]) if reply.flags & Flag.DIRECT and fds else None
        return ShmSendChannel(sock, ring, peer_arena, max_inflight=max_inflight, max_retries=max_retries)


def _path_of(address: str) -> str:
    if not address.startswith(SCHEME):
        raise ValueError(f"shm address must look like shm:///path/to/socket, got {address!r}")
    return address[len(SCHEME) :]
