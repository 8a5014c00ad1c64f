"""The tcp transport backend, between real processes: KV tensors arrive bit-exact, and every
failure (corruption, truncation, a dead or stalled peer) ends in a clear error within its deadline."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

from sage_infer.transport.auth import answer_challenge, socket_io
from sage_infer.transport.backends.tcp import TcpSendChannel, parse_address
from sage_infer.transport.base import get_backend
from sage_infer.transport.transport_errors import (
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    TransferTimeout,
    TransportError,
    TruncatedError,
)
from sage_infer.transport.wire import HEADER_BYTES, ChunkHeader, Kind, checksum

SPAWN = mp.get_context("spawn")
CHUNK = 256 << 10
DEADLINE_S = 5.0


def kv_cache(dtype: torch.dtype, layers: int = 4, blocks: int = 8, block_size: int = 16) -> torch.Tensor:
    """A KV cache as the engine holds it: [layers, 2, num_blocks, block_size, num_kv_heads=4, head_dim=64]."""
    torch.manual_seed(0)
    return torch.randn(layers, 2, blocks, block_size, 4, 64).to(dtype)


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def chunk_headers(payload: memoryview, request_id: str = "req-1", chunk: int = CHUNK) -> list[ChunkHeader]:
    count = -(-len(payload) // chunk)
    headers = []
    for i, offset in enumerate(range(0, len(payload), chunk)):
        view = payload[offset : offset + chunk]
        fields = dict(offset=offset, length=len(view), raw_length=len(view), count=count, crc=checksum(view))
        headers.append(ChunkHeader(Kind.DATA, request_id, seq=i, chunk_index=i, **fields))
    return headers


async def send_all(channel, payload: memoryview, headers: list[ChunkHeader], deadline: float) -> None:
    for h in headers:
        await channel.send(h, payload[h.offset : h.offset + h.length], deadline)
    await channel.drain(deadline)


def deadline_in(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


def error_of(outcome: tuple) -> tuple[str, str]:
    assert outcome[0] == "error", f"expected the receiver to fail, it returned {outcome[:1]}"
    return outcome[1], outcome[2]


# -- child processes (module level, so "spawn" can import them) ------------------------------


def serve_receivers(addresses, results) -> None:
    """A receiver process: on its first address it receives each connection's transfer and reports
    ("ok", bytes, chunks) or ("error", type, message); on its second it accepts and never reads."""

    async def receive(channel) -> tuple:
        chunks: dict[int, bytearray] = {}

        def sink(h: ChunkHeader) -> memoryview:
            chunks[h.offset] = bytearray(h.length)
            return memoryview(chunks[h.offset])

        received = 0
        try:
            while await channel.recv(sink, deadline_in(DEADLINE_S)):
                received += 1
        except Exception as err:
            return "error", type(err).__name__, str(err)
        finally:
            await channel.aclose()
        return "ok", b"".join(chunks[offset] for offset in sorted(chunks)), received

    async def never_read(listener) -> None:
        idle = []
        while True:
            idle.append(await listener.accept(deadline_in(3600)))

    async def main():
        tcp = get_backend("tcp")
        reading, idle = await tcp.listen(), await tcp.listen()
        addresses.put((reading.address, idle.address))
        asyncio.ensure_future(never_read(idle))
        while True:
            results.put(await receive(await reading.accept(deadline_in(3600))))

    asyncio.run(main())


def receive_two_then_hang(addresses, notes) -> None:
    async def main():
        listener = await get_backend("tcp").listen()
        addresses.put(listener.address)
        channel = await listener.accept(deadline_in(DEADLINE_S))
        for _ in range(2):
            await channel.recv(lambda h: memoryview(bytearray(h.length)), deadline_in(DEADLINE_S))
        notes.put("received 2 chunks")
        await asyncio.sleep(60)  # alive, never reading again, until killed

    asyncio.run(main())


def send_half_then_stall(address: str, nbytes: int) -> None:
    async def main():
        payload = memoryview(os.urandom(nbytes))
        headers = chunk_headers(payload)
        channel = await get_backend("tcp").connect(address)
        await send_all(channel, payload, headers[: len(headers) // 2], deadline_in(DEADLINE_S))
        await asyncio.sleep(60)  # connection open, nothing more sent

    asyncio.run(main())


class Child:
    """A child process running `target(addresses, results, *args)`, with the address(es) it listens on."""

    def __init__(self, target, *args) -> None:
        self.addresses, self.results = SPAWN.Queue(), SPAWN.Queue()
        self.process = SPAWN.Process(target=target, args=(self.addresses, self.results, *args), daemon=True)
        self.process.start()
        self.address = self.addresses.get(timeout=60)

    def result(self) -> tuple:
        return self.results.get(timeout=20)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


@pytest.fixture(scope="module")
def _server():
    child = Child(serve_receivers)
    child.address, child.idle_address = child.address
    yield child
    child.stop()


@pytest.fixture
def receiver(_server):
    """The shared receiver process; `receiver.address` receives, `receiver.idle_address` never reads."""
    while not _server.results.empty():  # a result left by a failed test must not answer this one
        _server.results.get()
    return _server


class CorruptingChannel(TcpSendChannel):
    """Flips one payload byte of chunk `seq` on its first `times` transmissions (the source stays intact)."""

    def __init__(self, sock: socket.socket, address: str, *, seq: int, times: int, **kwargs) -> None:
        super().__init__(sock, address, **kwargs)
        self.seq, self.times_left = seq, times

    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        if header.kind is Kind.DATA and header.seq == self.seq and self.times_left:
            self.times_left -= 1
            bad = bytearray(payload)
            bad[len(bad) // 2] ^= 0x01
            payload = memoryview(bad)
        await super()._transmit(header, payload, deadline)


async def corrupting_channel(address: str, *, seq: int, times: int) -> CorruptingChannel:
    sock = socket.create_connection(parse_address(address), timeout=DEADLINE_S)
    sock.setblocking(False)
    await answer_challenge(*socket_io(sock), None, address)  # the listener's opening message (no token)
    return CorruptingChannel(sock, address, seq=seq, times=times)


# -- delivery ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_cache_arrives_bit_exact_in_another_process(receiver, dtype):
    kv = kv_cache(dtype)
    payload = as_bytes(kv)

    async def send():
        channel = await get_backend("tcp").connect(receiver.address, max_inflight=4)
        await send_all(channel, payload, chunk_headers(payload), deadline_in(DEADLINE_S))
        await channel.aclose()
        return channel.retransmits

    assert asyncio.run(send()) == 0
    status, received, chunks = receiver.result()
    assert status == "ok" and chunks == len(chunk_headers(payload))
    assert torch.equal(torch.frombuffer(bytearray(received), dtype=torch.uint8).view(dtype).view(kv.shape), kv)


def test_listener_binds_loopback_on_an_ephemeral_port_by_default():
    async def main():
        listener = await get_backend("tcp").listen()
        await listener.aclose()
        return listener.address

    host, port = parse_address(asyncio.run(main()))
    assert host == "127.0.0.1" and port > 0


# -- corruption -------------------------------------------------------------------------------


def test_corrupted_chunk_is_nacked_and_resent(receiver):
    kv = kv_cache(torch.float16)
    payload = as_bytes(kv)

    async def send():
        channel = await corrupting_channel(receiver.address, seq=1, times=1)
        await send_all(channel, payload, chunk_headers(payload), deadline_in(DEADLINE_S))
        await channel.aclose()
        return channel.retransmits

    assert asyncio.run(send()) == 1
    status, received, _ = receiver.result()
    assert status == "ok"
    assert torch.equal(torch.frombuffer(bytearray(received), dtype=torch.uint8).view(torch.float16).view(kv.shape), kv)


def test_chunk_corrupt_on_every_send_fails_on_both_sides(receiver):
    payload = as_bytes(kv_cache(torch.bfloat16))

    async def send():
        channel = await corrupting_channel(receiver.address, seq=0, times=100)
        try:
            await send_all(channel, payload, chunk_headers(payload), deadline_in(DEADLINE_S))
        finally:
            await channel.aclose()

    with pytest.raises(ChecksumError, match="failed its CRC at the receiver 3 times"):
        asyncio.run(send())
    kind, message = error_of(receiver.result())
    assert kind == "ChecksumError" and "still corrupt after 2 resends" in message


def raw_connection(address: str) -> socket.socket:
    """A plain socket to the listener, past its opening message (so closing it sends no reset)."""
    raw = socket.create_connection(parse_address(address), timeout=DEADLINE_S)
    opening = ChunkHeader.unpack(raw.recv(HEADER_BYTES, socket.MSG_WAITALL))
    assert (opening.kind, opening.length) == (Kind.AUTH, 0)  # open: this listener checks no token
    return raw


def test_corrupted_header_is_rejected_before_any_payload_is_read(receiver):
    payload = memoryview(os.urandom(CHUNK))
    header = bytearray(chunk_headers(payload)[0].pack())
    header[40] ^= 0x10  # inside the offset field
    with raw_connection(receiver.address) as raw:
        raw.sendall(bytes(header) + bytes(payload))
        kind, message = error_of(receiver.result())
    assert kind == "ChecksumError" and "corrupt header" in message


def test_stream_cut_inside_a_payload_is_truncated(receiver):
    payload = memoryview(os.urandom(CHUNK))
    with raw_connection(receiver.address) as raw:
        raw.sendall(chunk_headers(payload)[0].pack() + bytes(payload[: CHUNK // 2]))
    kind, message = error_of(receiver.result())
    assert kind == "TruncatedError" and f"{CHUNK // 2} of {CHUNK} bytes" in message


def test_abort_from_the_sender_names_the_request(receiver):

    async def send():
        channel = await get_backend("tcp").connect(receiver.address)
        await channel.abort("req-42", "prefill failed")
        await channel.aclose()

    asyncio.run(send())
    kind, message = error_of(receiver.result())
    assert kind == "TransportError" and "req-42" in message


async def first_recv_error(junk: bytes) -> type[Exception]:
    """What an in-process receiver raises when a connection sends `junk` and closes."""
    listener = await get_backend("tcp").listen()
    _, writer = await asyncio.open_connection(*parse_address(listener.address))
    channel = await listener.accept(deadline_in(DEADLINE_S))
    writer.write(junk)
    writer.close()
    try:
        with pytest.raises(TransportError) as err:
            await channel.recv(lambda h: memoryview(bytearray(h.length)), deadline_in(DEADLINE_S))
        return err.type
    finally:
        await channel.aclose()
        await listener.aclose()


def test_a_stream_that_is_not_sage_is_rejected():
    assert asyncio.run(first_recv_error(b"GET / HTTP/1.1\r\n" * 8)) in (ChecksumError, ProtocolError)


def test_a_stream_cut_inside_a_header_is_truncated():
    assert asyncio.run(first_recv_error(b"SKVT" + bytes(20))) is TruncatedError


# -- dead and stalled peers -------------------------------------------------------------------


def test_killed_receiver_fails_the_sender_promptly():
    payload = as_bytes(kv_cache(torch.float16, blocks=64))  # 16 MiB: more than the socket buffers hold
    receiver = Child(receive_two_then_hang)

    async def send():
        channel = await get_backend("tcp").connect(receiver.address, max_inflight=8)
        loop = asyncio.get_running_loop()
        sending = asyncio.ensure_future(send_all(channel, payload, chunk_headers(payload), deadline_in(15)))
        await loop.run_in_executor(None, receiver.results.get, True, 20)  # "received 2 chunks"
        assert not sending.done()
        os.kill(receiver.process.pid, signal.SIGKILL)
        started = time.monotonic()
        try:
            await sending
        finally:
            await channel.aclose()
            assert time.monotonic() - started < 10  # not the 15 s deadline: the loss itself ended it

    try:
        with pytest.raises(PeerClosedError, match="tcp"):
            asyncio.run(send())
    finally:
        receiver.stop()


def test_receiver_that_never_reads_times_out_the_senders_drain(receiver):
    payload = memoryview(os.urandom(4 * 64 << 10))

    async def send():
        channel = await get_backend("tcp").connect(receiver.idle_address)
        try:
            await send_all(channel, payload, chunk_headers(payload, chunk=64 << 10), deadline_in(1.5))
        finally:
            await channel.aclose()

    with pytest.raises(TransferTimeout, match="acknowledge 4 chunk"):
        asyncio.run(send())


def test_sender_that_stalls_halfway_times_out_the_receiver():
    nbytes = 8 * CHUNK

    async def main():
        listener = await get_backend("tcp").listen()
        sender = SPAWN.Process(target=send_half_then_stall, args=(listener.address, nbytes), daemon=True)
        sender.start()
        try:
            channel = await listener.accept(deadline_in(30))
            dest = memoryview(bytearray(nbytes))
            received = 0
            with pytest.raises(TransferTimeout, match="peer stalled") as err:
                while await channel.recv(lambda h: dest[h.offset : h.offset + h.length], deadline_in(1.5)):
                    received += 1
            await channel.aclose()
            return received, str(err.value)
        finally:
            sender.kill()
            sender.join(10)
            await listener.aclose()

    received, message = asyncio.run(main())
    assert received == 4 and "between messages" in message


# -- connecting -------------------------------------------------------------------------------


def test_connect_to_a_closed_port_says_nothing_is_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free again once closed
    with pytest.raises(PeerClosedError, match="refused"):
        asyncio.run(get_backend("tcp").connect(f"tcp://127.0.0.1:{port}", timeout_s=2))


def test_connect_to_a_host_that_never_answers_times_out():
    # A listener whose accept queue is full drops new SYNs: the handshake never completes.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued: list[socket.socket] = []
        try:
            while len(queued) < 16:
                queued.append(socket.create_connection(full.getsockname(), timeout=0.3))
            pytest.skip("this kernel completes handshakes past a full accept queue")
        except TimeoutError:
            pass  # the queue is full
        host, port = full.getsockname()
        try:
            with pytest.raises(TransferTimeout, match="timed out after 0.5 s"):
                asyncio.run(get_backend("tcp").connect(f"tcp://{host}:{port}", timeout_s=0.5))
        finally:
            for s in queued:
                s.close()


@pytest.mark.parametrize("address", ["127.0.0.1:80", "tcp://127.0.0.1", "tcp://:80", "tcp://h:99999", "shm://x"])
def test_malformed_address_is_one_clear_error(address):
    with pytest.raises(TransportError, match="expected tcp://HOST:PORT"):
        parse_address(address)
