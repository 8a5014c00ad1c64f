"""torch.distributed backend: KV chunks as point-to-point messages inside a process group.

For multi-GPU / multi-host deployments launched by torchrun or Ray. The caller initialises
the process group (`init_process_group`); this backend never builds a cluster. Addresses
are ranks: `connect("torchdist://1")` sends to rank 1, `listen("torchdist://0")` accepts the
channel rank 0 opens (`listen()` accepts from the other rank of a two-rank group, or from any rank).

Every message is a 128-byte header tensor (wire.py); a DATA header is followed by its payload
tensor. A connection request goes on one fixed tag carrying a per-process channel number in
`slot`; channel `c` then uses its own data tag (sender -> receiver) and control tag (ACK/NACK,
receiver -> sender), so channels between the same ranks never mix. A HELLO with `Flag.LAST`
says "closed" in either direction. With gloo the payload is received straight into the sink's
memory (`torch.frombuffer`); with a device backend (nccl, hccl, ...) it is staged through a
tensor on the group's device.

Why daemon threads wait on the works: gloo's `is_completed()` never turns true for a send or
receive until someone calls `wait()`, `get_future()` is not implemented for them, and a `wait`
that times out closes the gloo pair to that peer for the whole process group. So each work is
waited on without a timeout by a per-channel daemon thread, and deadlines are enforced on the
asyncio side (`before`). A dead peer ends those waits ("Connection closed by peer" ->
`PeerClosedError`); a stalled one leaves them parked, which never keeps the process from exiting.

Limitations: gloo cannot cancel a posted receive. A receiver that times out between chunks keeps
its posted header receive and stays usable; one that times out in the middle of a payload is
broken, and the peer may still write that payload into the sink later, so the sink memory must
stay allocated until the peer is gone or the process group is destroyed. A connect that times
out leaves its connection request posted; a later `accept` on the peer then gets a channel on
which nothing arrives. NCCL ignores tags, so on a device backend use at most one channel per
direction between two ranks; the device path is untested here (CI has no multi-GPU machine).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist

from sage_infer.transport.base import (
    Availability,
    Backend,
    Listener,
    RecvChannel,
    SendChannel,
    Sink,
    before,
    register_backend,
)
from sage_infer.transport.transport_errors import (
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from sage_infer.transport.wire import HEADER_BYTES, ChunkHeader, Flag, Kind

SCHEME = "torchdist://"
HELLO_TAG = 0x5E00_0000  # connection requests; channel c uses HELLO_TAG + 1 + 2c (data) and + 2 + 2c (control)
_FOREVER = timedelta(days=365)  # see the module docstring: a gloo wait that times out closes the pair
_PEER_GONE = ("Connection closed by peer", "Connection reset", "Broken pipe", "pair closure", "closed")
_channel_numbers = itertools.count()


def _data_tag(channel: int) -> int:
    return HELLO_TAG + 1 + 2 * channel


def _control_tag(channel: int) -> int:
    return HELLO_TAG + 2 + 2 * channel


class TorchDistSendChannel(SendChannel):
    """Posts header (+ payload) sends on the channel's data tag; a reader task takes ACK/NACKs
    off the control tag. `_transmit` returns once the sends are posted: gloo sends them in order,
    and the payload stays registered until its ACK anyway (the base class resends from it)."""

    backend = "torchdist"

    def __init__(self, peer: int, channel: int, *, max_inflight: int = 8, max_retries: int = 2) -> None:
        super().__init__(max_inflight=max_inflight, max_retries=max_retries)
        self.peer = peer
        self.channel = channel
        self._device = _group_device()
        loop = asyncio.get_running_loop()
        self._sends = _Waiter(loop, f"torchdist-send-{peer}-{channel}", self._device)
        self._controls = _Waiter(loop, f"torchdist-ctrl-{peer}-{channel}", self._device)
        self._reader: asyncio.Task | None = None

    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        tag = _data_tag(self.channel)
        tensors = [_header_tensor(header, self._device)]
        if header.length:
            if payload.nbytes != header.length:
                raise ProtocolError(f"torchdist: payload is {payload.nbytes} bytes, header says {header.length}")
            tensors.append(_payload_tensor(payload, self._device))
        for tensor in tensors:
            sent = self._sends.submit(_post(dist.isend, tensor, self.peer, tag))
            sent.add_done_callback(self._on_sent)

    def _on_sent(self, sent: asyncio.Future) -> None:
        err = sent.exception()
        if err is not None:
            self._fail(_transport_error(err, "sending", self.peer))

    async def _read_controls(self) -> None:
        buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self._device)
        try:
            while True:
                work = _post(dist.irecv, buf, self.peer, _control_tag(self.channel))
                await self._controls.submit(work)
                msg = ChunkHeader.unpack(_host_bytes(buf))
                if msg.kind is Kind.HELLO:
                    self._on_lost("it closed the channel")
                    return
                self._on_control(msg)
        except TransportError as err:
            if isinstance(err, PeerClosedError):
                self._on_lost(str(err))
            else:
                self._fail(err)
        except RuntimeError as err:  # gloo: the pair broke
            self._on_lost(_gloo_message(err))

    async def _close(self) -> None:
        if self._error is None:  # tell the receiver; its reply ends our posted control receive
            bye = ChunkHeader(Kind.HELLO, "torchdist:bye", flags=Flag.LAST)
            try:
                self._sends.submit(
                    _post(dist.isend, _header_tensor(bye, self._device), self.peer, _data_tag(self.channel))
                )
            except TransportError:
                pass
        if self._reader is not None:
            self._reader.cancel()
        self._sends.stop()
        self._controls.stop()


class TorchDistRecvChannel(RecvChannel):
    """Receives header, then payload straight into the sink, from one rank on one channel.
    The next header's receive is posted together with a payload's, so the sender never waits
    for us to ask. (Checking the CRC in a thread while the next payload arrives measured no
    faster in `sage transport bench`, so the check stays inline.)"""

    backend = "torchdist"

    def __init__(self, peer: int, channel: int, *, max_retries: int = 2) -> None:
        super().__init__(max_retries=max_retries)
        self.peer = peer
        self.channel = channel
        self._device = _group_device()
        loop = asyncio.get_running_loop()
        self._recvs = _Waiter(loop, f"torchdist-recv-{peer}-{channel}", self._device)
        self._replies = _Waiter(loop, f"torchdist-ack-{peer}-{channel}", self._device)
        self._header_buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self._device)
        self._next_header: asyncio.Future | None = None  # the posted receive of the next header
        self._error: TransportError | None = None
        self._ended = False

    async def recv(self, sink: Sink, deadline: float) -> ChunkHeader | None:
        while True:
            if self._error is not None:
                raise self._error
            if self._ended:
                return None
            header = await self._recv_header(deadline)
            if header.kind is Kind.HELLO and header.flags & Flag.LAST:
                self._ended = True
                self._reply(ChunkHeader(Kind.HELLO, "torchdist:bye", flags=Flag.LAST))
                return None
            if header.kind is Kind.ABORT:
                raise TransportError(f"torchdist: rank {self.peer} aborted transfer {header.request_id!r}")
            if header.kind is not Kind.DATA:
                raise self._broken(ProtocolError(f"torchdist: unexpected {header.kind.name} from rank {self.peer}"))
            chunk = self._stage(header, sink)
            await self._land(chunk, deadline)
            try:
                chunk.header.verify(chunk.view)
            except ChecksumError as err:
                self._reply(chunk.header.reply(Kind.NACK))  # before giving up, so the sender fails too
                self._note_corrupt(chunk.header, err)
                continue
            self._reply(chunk.header.reply(Kind.ACK))
            return chunk.header

    async def _recv_header(self, deadline: float) -> ChunkHeader:
        if self._next_header is None:
            self._post_header()
        # A deadline here leaves the posted receive in place: the next recv() picks it up.
        what = f"waiting for the next chunk from rank {self.peer}"
        try:
            await _settled(self._next_header, deadline, what, self.peer)
        except TransferTimeout:
            raise
        except TransportError as err:
            raise self._broken(err) from None
        return self._take_header()

    def _take_header(self) -> ChunkHeader:
        self._next_header = None
        try:
            return ChunkHeader.unpack(_host_bytes(self._header_buf))
        except TransportError as err:  # a corrupt header: we cannot tell how long its payload is
            raise self._broken(err) from None

    def _stage(self, header: ChunkHeader, sink: Sink) -> _Staged:
        """Post the receive of `header`'s payload into the sink's buffer, then the next header's."""
        try:
            view = sink(header)
        except Exception as err:
            raise self._broken(
                TransportError(f"torchdist: the sink refused chunk {header.chunk_index}: {err}")
            ) from err
        if view.nbytes != header.length or view.readonly:
            raise self._broken(
                ValueError(f"sink gave {view.nbytes} bytes (readonly={view.readonly}) for {header.length}")
            )
        dest, received = None, None
        if header.length:
            dest = _payload_tensor(view, self._device, writable=True)
            received = self._recvs.submit(_post(dist.irecv, dest, self.peer, _data_tag(self.channel)))
        self._post_header()  # the header buffer is parsed already; gloo matches a tag's receives in order
        return _Staged(header, view, dest, received)

    async def _land(self, chunk: _Staged, deadline: float) -> None:
        if chunk.received is None:
            return
        header = chunk.header
        what = f"receiving chunk {header.chunk_index} of layer {header.layer} ({header.length} B) from rank {self.peer}"
        try:
            await _settled(chunk.received, deadline, what, self.peer)
        except TransportError as err:
            # The posted receive cannot be withdrawn: the payload may still land in the sink later.
            raise self._broken(err) from None
        if chunk.dest.device.type != "cpu":
            _payload_tensor(chunk.view, torch.device("cpu"), writable=True).copy_(chunk.dest)

    def _post_header(self) -> None:
        work = _post(dist.irecv, self._header_buf, self.peer, _data_tag(self.channel))
        self._next_header = self._recvs.submit(work)

    def _reply(self, msg: ChunkHeader) -> None:
        """ACK/NACK/bye to the sender; not awaited (a broken pair shows on our next receive)."""
        try:
            work = _post(dist.isend, _header_tensor(msg, self._device), self.peer, _control_tag(self.channel))
        except TransportError:
            return
        self._replies.submit(work)

    def _broken(self, err: Exception) -> TransportError:
        if self._error is None:
            self._error = err if isinstance(err, TransportError) else TransportError(f"torchdist: {err}")
        return self._error

    async def aclose(self) -> None:
        if not self._ended and self._error is None:
            self._reply(ChunkHeader(Kind.HELLO, "torchdist:bye", flags=Flag.LAST))  # the sender's reader stops
        self._ended = True
        self._recvs.stop()
        self._replies.stop()


class TorchDistListener(Listener):
    """Accepts channels from one rank (or any): each accept takes one connection request."""

    def __init__(self, peer: int | None, *, max_retries: int = 2) -> None:
        self.address = f"{SCHEME}{dist.get_rank()}"
        self.peer = peer
        self.max_retries = max_retries
        self._device = _group_device()
        self._waiter = _Waiter(asyncio.get_running_loop(), f"torchdist-listen-{dist.get_rank()}", self._device)
        self._buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self._device)
        self._work = None
        self._hello: asyncio.Future | None = None
        self._closed = False

    async def accept(self, deadline: float) -> RecvChannel:
        if self._closed:
            raise TransportError(f"torchdist: listener {self.address} is closed")
        if self._hello is None:  # kept across a timed-out accept: the request may still come
            self._work = _post(dist.irecv, self._buf, self.peer, HELLO_TAG)
            self._hello = self._waiter.submit(self._work)
        who = "any rank" if self.peer is None else f"rank {self.peer}"
        await _settled(self._hello, deadline, f"waiting for {who} to connect", self.peer)
        self._hello = None
        hello = ChunkHeader.unpack(_host_bytes(self._buf))
        if hello.kind is not Kind.HELLO:
            raise ProtocolError(f"torchdist: expected a connection request, got {hello.kind.name}")
        peer = self.peer if self.peer is not None else self._work.source_rank()
        return TorchDistRecvChannel(peer, hello.slot, max_retries=self.max_retries)

    async def aclose(self) -> None:
        self._closed = True
        self._waiter.stop()


@register_backend
class TorchDistBackend(Backend):
    """Point-to-point over the caller's torch.distributed process group."""

    name = "torchdist"
    description = "torch.distributed point-to-point (gloo on CPU, the group's device backend on accelerators)"
    send_channel: ClassVar[type[TorchDistSendChannel]] = TorchDistSendChannel  # tests swap in a faulty one

    @classmethod
    def availability(cls) -> Availability:
        if not dist.is_available():
            return Availability(cls.name, False, "this torch build has no torch.distributed")
        return Availability(
            cls.name, True, "needs an initialised process group (torchrun, Ray or dist.init_process_group)"
        )

    async def listen(self, address: str | None = None, *, max_retries: int = 2) -> Listener:
        _require_group()
        if address is not None:
            peer = _peer_rank(address)
        elif dist.get_world_size() == 2:
            peer = 1 - dist.get_rank()
        else:
            peer = None  # any rank: the connection request says who
        return TorchDistListener(peer, max_retries=max_retries)

    async def connect(
        self, address: str, *, max_inflight: int = 8, max_retries: int = 2, timeout_s: float = 30.0
    ) -> SendChannel:
        _require_group()
        peer = _peer_rank(address)
        channel = self.send_channel(peer, next(_channel_numbers), max_inflight=max_inflight, max_retries=max_retries)
        hello = ChunkHeader(Kind.HELLO, "torchdist:hello", slot=channel.channel)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            sent = channel._sends.submit(_post(dist.isend, _header_tensor(hello), peer, HELLO_TAG))
            await _settled(sent, deadline, f"connecting to rank {peer} (is it listening?)", peer)
        except BaseException:
            channel._sends.stop()
            channel._controls.stop()
            raise
        channel._reader = asyncio.get_running_loop().create_task(channel._read_controls())
        return channel


@dataclass(slots=True)
class _Staged:
    header: ChunkHeader
    view: memoryview
    dest: torch.Tensor | None  # what the payload is received into (`view` itself on the CPU)
    received: asyncio.Future | None  # None for an empty payload


class _Waiter:
    """A daemon thread that waits on works in the order they were posted (gloo completes the
    works of one tag and direction in that order) and settles a loop future for each."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, device: torch.device) -> None:
        self._loop = loop
        self._poll = device.type != "cpu"  # device works: is_completed() is the host-side test
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work) -> asyncio.Future:
        done = self._loop.create_future()
        done.add_done_callback(_consume_exception)
        self._queue.put((work, done))
        return done

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done = item
            err = None
            try:
                while self._poll and not work.is_completed():
                    time.sleep(50e-6)
                work.wait(_FOREVER)
            except Exception as exc:  # noqa: BLE001  (handed to the loop)
                err = exc
            try:
                self._loop.call_soon_threadsafe(_settle, done, err)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return


def _settle(done: asyncio.Future, err: BaseException | None) -> None:
    if not done.done():
        if err is None:
            done.set_result(None)
        else:
            done.set_exception(err)


def _consume_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _settled(done: asyncio.Future, deadline: float, what: str, peer: int | None) -> None:
    """Wait for a waiter's future until `deadline` without cancelling it; map gloo errors."""
    try:
        await before(asyncio.shield(done), deadline, what)
    except RuntimeError as err:
        raise _transport_error(err, what, peer) from None


def _post(op, tensor: torch.Tensor, peer: int | None, tag: int):
    """`dist.isend`/`dist.irecv`; a pair that is already broken raises here."""
    try:
        return op(tensor, peer, tag=tag)
    except RuntimeError as err:
        raise _transport_error(err, "posting a message", peer) from None


def _transport_error(err: BaseException, what: str, peer: int | None) -> TransportError:
    if isinstance(err, TransportError):
        return err
    text = _gloo_message(err)
    if any(sign in text for sign in _PEER_GONE):
        return PeerClosedError(f"torchdist: rank {peer} went away while {what} ({text})")
    return TransportError(f"torchdist: {what} failed: {text}")


def _gloo_message(err: BaseException) -> str:
    """The first line of a gloo error without its source-file prefix and boilerplate advice."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(" This is typically", 1)[0]


def _header_tensor(header: ChunkHeader, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    tensor = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    return tensor if device.type == "cpu" else tensor.to(device)


def _payload_tensor(view: memoryview, device: torch.device, *, writable: bool = False) -> torch.Tensor:
    """The bytes of `view` as a uint8 tensor on `device`: the same memory on the CPU."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable or not view.readonly:
        tensor = torch.frombuffer(view, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():  # a send only reads the buffer
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(view, dtype=torch.uint8)
    return tensor if device.type == "cpu" else tensor.to(device)


def _host_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes()


def _group_device() -> torch.device:
    """Where this group's messages live: the CPU for gloo, else the device of its backend."""
    backend = str(dist.get_backend())
    if "gloo" in backend:
        return torch.device("cpu")
    for device_type, name in dist.Backend.default_device_backend_map.items():
        if device_type != "cpu" and name in backend:
            return torch.device(device_type, getattr(torch, device_type).current_device())
    raise TransportError(f"torchdist: don't know which device the {backend!r} process group uses")


def _require_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise TransportError(
            "torchdist: no torch.distributed process group is initialised in this process; "
            "start under torchrun/Ray or call torch.distributed.init_process_group() first"
        )


def _peer_rank(address: str) -> int:
    rank = address.removeprefix(SCHEME)
    if not address.startswith(SCHEME) or not rank.isdigit():
        raise TransportError(f"torchdist: bad address {address!r}; expected {SCHEME}RANK")
    peer, me, size = int(rank), dist.get_rank(), dist.get_world_size()
    if peer >= size or peer == me:
        raise TransportError(f"torchdist: rank {peer} is not another rank of this group (this is rank {me} of {size})")
    return peer
