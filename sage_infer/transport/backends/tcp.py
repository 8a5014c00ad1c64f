"""TCP backend: KV chunks between hosts over one asyncio TCP connection per transfer.

Zero-copy on both ends. The sender hands the kernel the 128-byte header and the registered
source view in one `sendmsg`, resuming from the same view after a partial send. The receiver
is an `asyncio.BufferedProtocol` whose `get_buffer` returns first the header buffer, then the
view its `sink` gave for the chunk, so the payload lands straight in the destination. It reads
one message per `recv()` and pauses in between, so it never reads a byte it has nowhere to put.
The payload CRC is computed piece by piece as each read lands, while those bytes are still in
cache, instead of re-reading the whole chunk from memory afterwards.
ACK/NACK flow back on the same connection; the sender keeps `max_inflight` chunks unacked.
The listener opens every connection first (auth.py: the shared-token challenge when it has one).

    listener = await backend.listen()  # tcp://127.0.0.1:<ephemeral> unless told otherwise
    channel = await backend.connect(listener.address)  # on the sending host
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import zlib

import crc32c
import torch

from sage_infer.transport.accept import AcceptingListener, OnRefused
from sage_infer.transport.auth import answer_challenge, socket_io
from sage_infer.transport.base import Backend, Listener, RecvChannel, SendChannel, Sink, before, register_backend
from sage_infer.transport.format.converter import PendingEncode
from sage_infer.transport.transport_errors import (
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    TransferTimeout,
    TransportError,
    TruncatedError,
)
from sage_infer.transport.wire import HEADER_BYTES, Checksum, ChunkHeader, Kind

DEFAULT_HOST = "127.0.0.1"  # a receiver is reachable from other hosts only when asked for
# Running CRC update functions, (data, crc so far) -> crc, by the header's algorithm.
_CRC_UPDATE = {Checksum.CRC32C: crc32c.crc32c, Checksum.CRC32: zlib.crc32, Checksum.NONE: lambda data, crc: 0}


def parse_address(address: str) -> tuple[str, int]:
    """Split "tcp://host:port" (IPv6: "tcp://[::1]:port") into (host, port)."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit() or int(port) > 65535:
        raise TransportError(f"bad tcp address {address!r}: expected tcp://HOST:PORT, e.g. tcp://10.0.0.2:7400")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"tcp://[{host}]:{port}" if is_v6 else f"tcp://{host}:{port}"


class _ChunkReader(asyncio.BufferedProtocol):
    """The receiving side of one connection: reads exactly one message per `read_message()`.

    A message is a header and, for DATA, `header.length` payload bytes read into `sink(header)`.
    Reading is paused whenever no `read_message()` is waiting, so the kernel buffers the rest.
    """

    def __init__(self) -> None:
        self._header_buf = memoryview(bytearray(HEADER_BYTES))
        self._header: ChunkHeader | None = None
        self._payload: memoryview | None = None  # set while a DATA payload is being read
        self._filled = 0  # bytes of the current header (or payload) received so far
        self._crc = 0  # running CRC of the payload bytes received so far
        self._crc_update = crc32c.crc32c
        self._sink: Sink | None = None
        self._waiter: asyncio.Future | None = None
        self._end: Exception | None = None  # why the stream ended (None while open)
        self._clean_eof = False
        self.transport: asyncio.Transport | None = None
        self.peer = "?"

    # -- driven by TcpRecvChannel ---------------------------------------------

    def read_message(self, sink: Sink) -> asyncio.Future:
        """A future for the next message, (header, payload view or None, payload CRC), or None at a clean EOF."""
        waiter = asyncio.get_running_loop().create_future()
        if self._clean_eof:
            waiter.set_result(None)
        elif self._end is not None:
            waiter.set_exception(self._end)
        else:
            self._sink, self._waiter = sink, waiter
            self.transport.resume_reading()
        return waiter

    def reply(self, header: ChunkHeader) -> None:
        if not self.transport.is_closing():
            self.transport.write(header.pack())  # 128 bytes: the copy asyncio may make is harmless

    def progress(self) -> str:
        if self._payload is not None:
            h = self._header
            return (
                f"inside the payload of chunk {h.chunk_index} of layer {h.layer} of request {h.request_id!r} "
                f"({self._filled} of {h.length} bytes received)"
            )
        if self._filled:
            return f"inside a header ({self._filled} of {HEADER_BYTES} bytes received)"
        return "between messages"

    def close(self, why: Exception) -> None:
        """End the stream: later reads raise `why`, and nothing more is written into a sink's view."""
        self._finish(why)

    # -- asyncio callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.pause_reading()  # until the first recv(): no sink to read into yet
        peer = transport.get_extra_info("peername")
        self.peer = format_address(peer[0], peer[1]) if peer else "?"

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is None:
            return self._header_buf[self._filled :]
        return self._payload[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._payload is not None:
            start, self._filled = self._filled, self._filled + nbytes
            self._crc = self._crc_update(self._payload[start : self._filled], self._crc)
            if self._filled == len(self._payload):
                self._deliver(self._payload)
            return
        self._filled += nbytes
        if self._filled < HEADER_BYTES:
            return
        try:
            self._header = header = ChunkHeader.unpack(self._header_buf)
            if header.kind is not Kind.DATA:
                if header.length:
                    raise ProtocolError(f"tcp: {header.kind.name} message from {self.peer} claims a payload")
                self._deliver(None)
                return
            payload = self._destination(header)
        except Exception as err:  # a corrupt header or a sink that refused: the stream cannot go on
            self._finish(err)
            return
        self._filled, self._crc, self._crc_update = 0, 0, _CRC_UPDATE[header.algorithm]
        if len(payload) == 0:
            self._deliver(payload)
        else:
            self._payload = payload

    def eof_received(self) -> bool:
        if self._payload is None and self._filled == 0:
            self._finish(None)
        else:
            self._finish(TruncatedError(f"tcp: {self.peer} closed the connection {self.progress()}"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self._payload is None and self._filled == 0:
            self._finish(None)
        elif self._payload is not None or self._filled:
            self._finish(TruncatedError(f"tcp: connection from {self.peer} lost {self.progress()} ({exc})"))
        else:
            self._finish(PeerClosedError(f"tcp: connection from {self.peer} lost ({exc})"))

    # -- internals --------------------------------------------------------------

    def _destination(self, header: ChunkHeader) -> memoryview:
        view = memoryview(self._sink(header))
        if view.readonly:
            raise ValueError(f"sink gave a read-only buffer for chunk {header.chunk_index} of layer {header.layer}")
        if view.nbytes != header.length:
            raise ProtocolError(
                f"tcp: chunk {header.chunk_index} of layer {header.layer} of request {header.request_id!r} is "
                f"{header.length} bytes on the wire, but its registered buffer is {view.nbytes} bytes"
            )
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")

    def _deliver(self, payload: memoryview | None) -> None:
        self.transport.pause_reading()
        self._payload, self._filled = None, 0
        waiter, self._waiter, self._sink = self._waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self._header, payload, self._crc))

    def _finish(self, why: Exception | None) -> None:
        """End the stream (`why` None: a clean EOF between messages); the first ending sticks."""
        if self._end is None and not self._clean_eof:
            self._end, self._clean_eof = why, why is None
        waiter, self._waiter, self._sink = self._waiter, None, None
        self._payload = None  # nothing more lands in a sink's view
        if self.transport is not None:
            self.transport.close()
        if waiter is not None and not waiter.done():
            if self._end is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(self._end)


class TcpRecvChannel(RecvChannel):
    backend = "tcp"

    def __init__(self, reader: _ChunkReader, *, max_retries: int = 2) -> None:
        super().__init__(max_retries=max_retries)
        self._reader = reader
        self.peer = reader.peer

    async def recv(self, sink: Sink, deadline: float) -> ChunkHeader | None:
        while True:
            what = f"waiting for the next chunk from {self.peer}"
            try:
                msg = await before(self._reader.read_message(sink), deadline, what)
            except TransferTimeout as err:
                progress = self._reader.progress()
                self._reader.close(err)
                raise TransferTimeout(f"tcp: {err} ({progress})") from None
            except asyncio.CancelledError:
                self._reader.close(TransportError("tcp: a recv() on this channel was cancelled mid-message"))
                raise
            if msg is None:
                return None
            header, payload, crc = msg
            if header.kind is Kind.ABORT:
                err = TransportError(f"tcp: the sender at {self.peer} aborted transfer {header.request_id!r}")
                self._reader.close(err)
                raise err
            if header.kind is Kind.HELLO:
                continue
            if header.kind is not Kind.DATA:
                err = ProtocolError(f"tcp: unexpected {header.kind.name} message from the sender at {self.peer}")
                self._reader.close(err)
                raise err
            try:
                if crc != header.crc:
                    header.verify(payload)  # raises (the running CRC is only the fast path)
            except ChecksumError as err:
                # NACK first, so that a sender out of retries fails with the checksum error, not a hang-up.
                self._reader.reply(header.reply(Kind.NACK))
                self._note_corrupt(header, err)
                continue
            self._reader.reply(header.reply(Kind.ACK))
            return header

    async def aclose(self) -> None:
        self._reader.close(PeerClosedError("tcp: channel closed"))


class TcpSendChannel(SendChannel):
    backend = "tcp"
    encodes_in_place = True  # a converted chunk is encoded into one reused send buffer, its CRC in the same pass

    def __init__(self, sock: socket.socket, address: str, *, max_inflight: int = 8, max_retries: int = 2) -> None:
        super().__init__(max_inflight=max_inflight, max_retries=max_retries)
        self.address = address
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._writable: asyncio.Future | None = None
        self._encoded = torch.empty(0, dtype=torch.uint8)  # where converted chunks are encoded (sent one at a time)
        self._reader = self._loop.create_task(self._read_control())

    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        if self._closed:
            raise PeerClosedError(f"tcp: channel to {self.address} is closed")
        if isinstance(payload, PendingEncode):  # (sendmsg copies the bytes out before the next chunk reuses them)
            if self._encoded.numel() < len(payload):
                self._encoded = torch.empty(len(payload), dtype=torch.uint8)
            out = self._encoded[: len(payload)]
            head = header.pack(crc=payload.write(out, header.algorithm is Checksum.CRC32C))
            payload = memoryview(out.numpy())
        else:
            head = header.pack()
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")
        buffers = [head, payload] if payload.nbytes else [head]
        while True:
            try:
                sent = self._sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                sent = 0
            # Drop what went out; resume from a view of the rest (no copy).
            while sent:
                if sent >= len(buffers[0]):
                    sent -= len(buffers.pop(0))
                else:
                    buffers[0] = memoryview(buffers[0])[sent:]
                    sent = 0
            if not buffers:
                return
            await before(self._wait_writable(), deadline, f"sending to {self.address} (its socket buffer is full)")

    async def _wait_writable(self) -> None:
        self._writable = waiter = self._loop.create_future()
        self._loop.add_writer(self._fd, _set_result, waiter)
        try:
            await waiter
        finally:
            self._writable = None
            if self._sock.fileno() != -1:
                self._loop.remove_writer(self._fd)

    async def _read_control(self) -> None:
        view = memoryview(bytearray(HEADER_BYTES))
        try:
            while True:
                filled = 0
                while filled < HEADER_BYTES:
                    n = await self._loop.sock_recv_into(self._sock, view[filled:])
                    if n == 0:
                        self._lost("the receiver closed the connection")
                        return
                    filled += n
                self._on_control(ChunkHeader.unpack(view))
        except TransportError as err:
            self._fail(err)
            self._wake_writer()
        except OSError as err:
            self._lost(str(err) or type(err).__name__)

    def _lost(self, why: str) -> None:
        self._on_lost(why)
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(self._error or PeerClosedError(f"tcp: connection to {self.address} lost"))

    async def _close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._loop.remove_writer(self._fd)  # before the fd is closed; a waiting _transmit gets the error below
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(PeerClosedError(f"tcp: channel to {self.address} closed"))
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._sock.close()


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class TcpListener(AcceptingListener):
    def __init__(self, server: socket.socket, address: str, max_retries: int, **kw) -> None:
        self._max_retries = max_retries
        super().__init__(server, address, **kw)

    def _peer_of(self, sock: socket.socket) -> str:
        try:
            peer = sock.getpeername()
        except OSError:
            return "?"
        return format_address(peer[0], peer[1])

    async def _set_up(self, sock: socket.socket, deadline: float) -> RecvChannel:
        reader = _ChunkReader()
        await asyncio.get_running_loop().connect_accepted_socket(lambda: reader, sock=sock)
        return TcpRecvChannel(reader, max_retries=self._max_retries)


@register_backend
class TcpBackend(Backend):
    """One TCP connection per transfer; zero-copy `sendmsg` out, `recv_into` the KV buffers in."""

    name = "tcp"
    description = "TCP sockets between hosts (asyncio, zero-copy sendmsg / recv_into)"
    authenticates = True

    async def listen(
        self, address: str | None = None, *, max_retries: int = 2, token: bytes | None = None,
        setup_timeout_s: float = 30.0, on_refused: OnRefused | None = None,
    ) -> Listener:
        """`token`: connections must pass the shared-token handshake (auth.py); `setup_timeout_s` bounds
        each connection's handshake; `on_refused` hears of every connection turned away."""
        host, port = parse_address(address) if address else (DEFAULT_HOST, 0)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as err:
            raise TransportError(f"tcp: cannot listen on {address}: {err}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise TransportError(f"tcp: cannot listen on {format_address(host, port)}: {err}") from None
        bound = sock.getsockname()
        return TcpListener(sock, format_address(bound[0], bound[1]), max_retries, token=token,
                           setup_timeout_s=setup_timeout_s, on_refused=on_refused)

    async def connect(
        self, address: str, *, max_inflight: int = 8, max_retries: int = 2, timeout_s: float = 30.0,
        token: bytes | None = None,
    ) -> SendChannel:
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        timed_out = f"tcp: connecting to {address} timed out after {timeout_s:g} s (no answer from the receiver)"
        try:
            infos = await before(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), deadline, "resolving")
        except TransferTimeout:
            raise TransferTimeout(timed_out) from None
        except OSError as err:
            raise PeerClosedError(f"tcp: cannot resolve {host!r} of {address}: {err}") from None
        errors: list[OSError] = []
        for family, kind, proto, _, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                await before(loop.sock_connect(sock, sockaddr), deadline, f"connecting to {address}")
            except TransferTimeout:
                sock.close()
                raise TransferTimeout(timed_out) from None
            except OSError as err:
                sock.close()
                errors.append(err)
                continue
            except BaseException:
                sock.close()
                raise
            try:
                await before(answer_challenge(*socket_io(sock), token, f"tcp: {address}"), deadline,
                             f"opening the connection to {address}")
            except TransferTimeout:
                sock.close()
                raise TransferTimeout(timed_out) from None
            except BaseException:
                sock.close()
                raise
            return TcpSendChannel(sock, address, max_inflight=max_inflight, max_retries=max_retries)
        if errors and all(isinstance(err, ConnectionRefusedError) for err in errors):
            raise PeerClosedError(f"tcp: connection to {address} refused: nothing is listening there (receiver down?)")
        raise PeerClosedError(f"tcp: cannot connect to {address}: {errors[-1] if errors else 'no address found'}")
