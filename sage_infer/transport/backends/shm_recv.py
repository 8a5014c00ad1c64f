"""The receiving end of a shm connection (see shm.py for the whole backend).

It reads each 128-byte header from the Unix socket, copies the chunk out of the sender's ring
into the buffer its sink gives (a converted chunk is decoded from the ring straight into its
destination by the engine's decoder; a DIRECT chunk the sender already wrote into the
receiver's arena is only checked where it landed), verifies the CRC its pass took, and acknowledges.
ACKs go in runs: one covers up to `ACK_EVERY` consecutive verified chunks, or what holds half
the ring; a chunk flagged ACK_NOW (its sender waits for acknowledgements next) ends the run at
once, and so does running out of headers to read (the run goes before the channel waits, or
whenever its task yields). So runs form only while the receiver is behind, when they save the
sender one ACK to process per chunk; a receiver that keeps up acknowledges each chunk as it
goes idle, at no extra wake-up (a timer that held ACKs back for more chunks was tried: its
wake-ups cost more than the ACKs it saved, see benchmarks.md). Control messages (ACK, NACK,
PLACE) leave through one ordered, non-blocking outbox.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np

from sage_infer.quantization.kv_codec_kernel import ArrayCopy, array_copier
from sage_infer.transport.arena import SharedArena
from sage_infer.transport.base import Decoder, RecvChannel, Sink, before
from sage_infer.transport.transport_errors import (
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    TransportError,
    TruncatedError,
)
from sage_infer.transport.wire import HEADER_BYTES, Checksum, ChunkHeader, Flag, Kind

ACK_EVERY = 4  # at most this many verified chunks share one ACK (the sender's window is max_inflight, 8 by default)


async def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from a non-blocking socket; returns bytes read (short only at EOF)."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            break
        got += n
    return got


def copy_into(out: np.ndarray, ring: np.ndarray, algorithm: Checksum, fused: ArrayCopy | None) -> int | None:
    """Copy a chunk out of the ring; for a CRC32C chunk, where the one-pass kernel loads (`fused`,
    `kv_codec_kernel.array_copier`), also its CRC32C (the copy's bytes, read once), else None (the caller
    checksums `out`)."""
    if algorithm is Checksum.CRC32C and fused is not None:
        return fused(out, ring, 0, -1)
    np.copyto(out, ring)
    return None


class ShmRecvChannel(RecvChannel):
    """Acknowledges verified chunks in runs: one ACK covers up to `ACK_EVERY` consecutive chunks, or
    what holds half the ring. A chunk whose sender waits for acknowledgements after it (flag ACK_NOW:
    its window is full, its ring has no room for another chunk, it has nothing more queued, or it is
    a resend) ends the run at once, and so does having no next header to read."""

    backend = "shm"
    decodes_in_place = True

    def __init__(self, sock: socket.socket, ring: SharedArena, arena: SharedArena | None = None, **kw) -> None:
        super().__init__(**kw)
        self._sock = sock
        self._ring = ring
        self._ring_np = ring.array
        self._buf = bytearray(HEADER_BYTES)
        self._view = memoryview(self._buf)
        self.arena = arena
        self._loop = asyncio.get_running_loop()
        self._run: list[int] | None = None  # [first seq, last seq, ring bytes] verified, not yet acknowledged
        self._flush_scheduled = False  # a flush waits for this task to yield
        self._out = bytearray()  # control messages the socket has not taken yet, in order
        self._fused = array_copier()  # the one-pass copy + CRC32C, chosen once for the connection

    async def publish(self, request_id: str, regions: list[tuple[int, int]]) -> None:
        """Tell the sender where each layer of `request_id` lies in the arena (offset, bytes)."""
        payload = np.asarray(regions, dtype="<u8").tobytes()
        header = ChunkHeader(Kind.PLACE, request_id, length=len(payload), count=len(regions))
        self._write(header.pack() + payload)

    async def recv(self, sink: Sink, deadline: float, decoder: Decoder | None = None) -> ChunkHeader | None:
        """`decoder`: decodes a converted chunk straight out of the ring into its destination and returns the CRC
        it took reading it (None: it did not, and the chunk goes through `sink` as any other)."""
        try:
            while True:
                header = await self._next_header(deadline)
                if header is None:
                    return None
                if header.kind is Kind.ABORT:
                    raise TransportError(f"shm: the sender aborted transfer {header.request_id!r}")
                if header.kind is not Kind.DATA:
                    raise ProtocolError(f"shm: unexpected {header.kind.name} message from the sender")
                got = None  # the CRC32C of the chunk where the copy (or the decoding) took it
                if (decoder is not None and header.flags & Flag.CONVERTED and not header.flags & Flag.DIRECT
                        and header.algorithm is not Checksum.CRC32):  # (the decoder takes a CRC32C)
                    got = decoder(header, self._region(header))
                if got is not None:
                    out = None  # decoded into place: the CRC is the ring's bytes'
                else:
                    out, got = self._land(header, sink)
                try:
                    header.verify(out, got)
                except ChecksumError as err:
                    self._write(header.reply(Kind.NACK).pack())
                    self._note_corrupt(header, err)
                    continue
                self._acknowledge(header)
                return header
        except BaseException:
            self._flush_acks()  # what was verified stays verified
            raise

    def _region(self, header: ChunkHeader) -> np.ndarray:
        if header.slot + header.length > len(self._ring_np):
            raise ProtocolError(f"shm: chunk region {header.slot}+{header.length} lies outside the ring")
        return self._ring_np[header.slot : header.slot + header.length]

    def _land(self, header: ChunkHeader, sink: Sink) -> tuple[np.ndarray, int | None]:
        """Copy a chunk out of the ring into the view `sink` gives (a DIRECT chunk is there already: only where it
        lies is checked): that view as an array, and the CRC32C the copy took (None: the caller checksums it)."""
        dest = sink(header)
        if len(dest) != header.length:
            raise ValueError(f"sink gave {len(dest)} bytes for a {header.length}-byte chunk")
        out = np.frombuffer(dest, dtype=np.uint8)
        got = None
        if header.flags & Flag.DIRECT:  # already in place: only check where and what
            if self.arena is None or self.arena.offset_of(out) != header.slot:
                raise ProtocolError(f"shm: chunk {header.chunk_index} was written outside its destination")
        else:
            got = copy_into(out, self._region(header), header.algorithm, self._fused)
        return out, got

    async def _next_header(self, deadline: float) -> ChunkHeader | None:
        """The next header, or None at a clean EOF. The timer is armed only when it is not here yet."""
        try:
            got = self._sock.recv_into(self._view)
            if got == 0:
                return None
        except (BlockingIOError, InterruptedError):
            got = 0
        except OSError as err:
            raise PeerClosedError(f"shm: the sender's connection broke ({err})") from None
        if got < HEADER_BYTES:
            self._flush_acks()  # about to wait: what is verified goes now
            try:
                more = await before(recv_exactly(self._sock, self._view[got:]), deadline, "waiting for a chunk")
            except OSError as err:
                raise PeerClosedError(f"shm: the sender's connection broke ({err})") from None
            if got + more == 0:
                return None
            if got + more < HEADER_BYTES:
                raise TruncatedError(f"shm: stream ended inside a header ({got + more}/{HEADER_BYTES} bytes)")
        return ChunkHeader.unpack(self._buf)

    def _acknowledge(self, header: ChunkHeader) -> None:
        ring = 0 if header.flags & Flag.DIRECT else header.length
        run = self._run
        if run is not None and header.seq == run[1] + 1:
            run[1] = header.seq
            run[2] += ring
        else:
            self._flush_acks()
            run = self._run = [header.seq, header.seq, ring]
        if header.flags & Flag.ACK_NOW or run[1] - run[0] + 1 >= ACK_EVERY or 2 * run[2] >= len(self._ring_np):
            self._flush_acks()
        elif not self._flush_scheduled:  # in case nobody calls recv() again: when this task next yields
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_when_idle)

    def _flush_when_idle(self) -> None:
        self._flush_scheduled = False
        self._flush_acks()

    def _flush_acks(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._write(ChunkHeader.ack(run[0], run[1]))

    def _write(self, data: bytes) -> None:
        """Send a control message now, or queue it behind those the socket has not taken yet."""
        if self._sock.fileno() == -1:
            return
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return  # the sender is gone; the next read says so
            if sent == len(data):
                return
            data = data[sent:]
            self._loop.add_writer(self._sock.fileno(), self._drain)
        self._out += data

    def _drain(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(self._out)
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self._sock.fileno())

    async def aclose(self) -> None:
        if self._sock.fileno() == -1:
            return
        self._flush_acks()
        if self._out:
            self._loop.remove_writer(self._sock.fileno())
            try:
                self._sock.send(self._out)  # best effort: the sender may stop reading at any time
            except OSError:
                pass
        self._sock.close()
        del self._ring_np
        self._ring.close()
