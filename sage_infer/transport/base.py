"""The interface every transport backend implements, and what they share.

A backend moves (header, payload) pairs from a `SendChannel` in one process to a
`RecvChannel` in another. The sender keeps up to `max_inflight` chunks unacknowledged;
the receiver writes each payload straight into the buffer its `sink` hands out,
checks the CRC, and answers ACK (verified) or NACK (send again). The sender resends
a NACKed chunk from its still-registered source, up to `max_retries` times. Every
wait has the transfer's deadline, so a dead or stalled peer ends in an error, not a hang.

Backends register by name (`@register_backend`); `get_backend("shm")` builds one and
`backend_availability()` says, for every known backend, whether it runs here and why not.
"""

from __future__ import annotations

import asyncio
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

from sage_infer.transport.transport_errors import (
    BackendUnavailable,
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from sage_infer.transport.wire import ChunkHeader, Flag, Kind

T = TypeVar("T")

# Gives the destination for a chunk's payload: a writable memoryview of exactly `header.length` bytes.
Sink = Callable[[ChunkHeader], memoryview]
# Decodes a converted chunk's wire bytes (where the channel holds them) into the chunk's destination and returns
# their CRC32C, or None where it cannot (then the chunk goes through the sink): `KVReceiveBuffers.decode_from`.
Decoder = Callable[[ChunkHeader, Any], "int | None"]


async def before(aw: Awaitable[T], deadline: float, what: str) -> T:
    """Await `aw` until the loop-time `deadline`; past it raise `TransferTimeout` naming `what`."""
    if _timeout_at is None:  # Python 3.10
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(aw, max(remaining, 0))
        except asyncio.TimeoutError:
            raise TransferTimeout(f"peer stalled: deadline passed while {what}") from None
    scope = _timeout_at(deadline)  # no extra task per await, unlike wait_for
    try:
        async with scope:
            return await aw
    except TimeoutError:
        if scope.expired():
            raise TransferTimeout(f"peer stalled: deadline passed while {what}") from None
        raise


_timeout_at = getattr(asyncio, "timeout_at", None)
ABORT_TIMEOUT_S = 1.0


@dataclass(slots=True)
class _Pending:
    header: ChunkHeader
    payload: memoryview
    sent_at: float
    deadline: float
    acked: asyncio.Future
    retries: int = 0


class SendChannel(ABC):
    """The sending end of one connection. Subclasses implement `_transmit`, `_close` and
    feed the peer's ACK/NACK messages to `_on_control` (and call `_on_lost` on EOF)."""

    backend: ClassVar[str]
    computes_crc: ClassVar[bool] = False  # True: the channel fills in the CRC where it stages the payload
    # True: `send` takes a `converter.PendingEncode` as the payload and encodes it where it stages the bytes
    encodes_in_place: ClassVar[bool] = False

    def __init__(self, *, max_inflight: int = 8, max_retries: int = 2) -> None:
        self.max_inflight = max_inflight
        self.max_retries = max_retries
        self.retransmits = 0
        self._slots = asyncio.Semaphore(max_inflight)
        self._pending: dict[int, _Pending] = {}
        self._send_lock = asyncio.Lock()
        self._error: TransportError | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # resends in flight (referenced so they are not collected)

    @property
    def inflight(self) -> int:
        return len(self._pending)

    async def send(self, header: ChunkHeader, payload: memoryview, deadline: float,
                   acked: asyncio.Future | None = None) -> asyncio.Future:
        """Queue one chunk; returns once it is on the wire. The returned future (`acked`, when the
        caller brings one) resolves to the seconds from send to verified ACK, or raises the transfer's
        error. A timer is armed only while something has to wait (a slot, room, the socket), not per chunk."""
        self._raise_if_failed()
        if self._slots.locked():
            what = f"waiting for an in-flight slot ({self.max_inflight} unacked)"
            await before(self._slots.acquire(), deadline, what)
        else:
            await self._slots.acquire()  # free slot: no timer needed
        self._raise_if_failed()
        loop = asyncio.get_running_loop()
        if header.seq in self._pending:
            self._slots.release()
            raise ValueError(f"sequence number {header.seq} is already in flight")
        entry = _Pending(header, payload, loop.time(), deadline, acked if acked is not None else loop.create_future())
        entry.acked.add_done_callback(_consume_exception)
        self._pending[header.seq] = entry
        try:
            await self._locked_transmit(header, payload, deadline)
        except TransportError as err:
            self._fail(err)
            raise
        except OSError as err:
            self._fail(PeerClosedError(f"{self.backend}: send failed, peer gone? ({err})"))
            raise self._error from None
        except BaseException:
            self._pending.pop(header.seq, None)
            self._slots.release()
            raise
        return entry.acked

    async def drain(self, deadline: float) -> None:
        """Wait until every chunk sent so far is acknowledged."""
        pending = [p.acked for p in self._pending.values()]
        if pending:
            what = f"waiting for the receiver to acknowledge {len(pending)} chunk(s)"
            try:
                await before(asyncio.gather(*pending), deadline, what)
            except TransferTimeout as err:
                self._fail(err)
                raise
        self._raise_if_failed()

    async def wait_placed(self, request_id: str) -> None:
        """Wait until the receiver has placed `request_id` in registered memory (zero-copy
        backends); others have nothing to wait for."""
        return None

    async def abort(self, request_id: str, why: str = "") -> None:
        """Tell the receiver this transfer is abandoned (best effort, bounded: the peer may be
        the reason it failed). `why` is for logs; the header has no room for text."""
        deadline = asyncio.get_running_loop().time() + ABORT_TIMEOUT_S
        try:
            abort = self._locked_transmit(ChunkHeader(Kind.ABORT, request_id), memoryview(b""), deadline)
            await before(abort, deadline, "abort")  # the send lock may be held by a stuck send: bounded too
        except (OSError, TransportError):
            pass

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._close()
            self._fail(PeerClosedError(f"{self.backend}: channel closed"))

    # -- for subclasses --------------------------------------------------------

    @abstractmethod
    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        """Put one header (+ payload) on the wire; any wait (room, a full socket) ends at `deadline`."""

    @abstractmethod
    async def _close(self) -> None: ...

    async def _locked_transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        async with self._send_lock:
            await self._transmit(header, payload, deadline)

    def _acked(self, seq: int) -> None:
        """Hook: chunk `seq` is verified at the receiver (shm frees its ring region)."""
        return None

    def _on_control(self, msg: ChunkHeader) -> None:
        if msg.kind is Kind.ACK:  # chunks msg.seq - count + 1 .. msg.seq
            first = msg.seq - max(msg.count, 1) + 1
            if msg.count > len(self._pending):  # (a bogus count must not make this loop long)
                seqs = [seq for seq in self._pending if first <= seq <= msg.seq]
            else:
                seqs = range(first, msg.seq + 1)
            now = asyncio.get_running_loop().time()
            for seq in seqs:
                entry = self._pending.pop(seq, None)
                if entry is None:
                    continue  # late ACK of a chunk already settled
                self._acked(seq)
                self._slots.release()
                if not entry.acked.done():
                    entry.acked.set_result(now - entry.sent_at)
            return
        entry = self._pending.get(msg.seq)
        if msg.kind is Kind.NACK:
            if entry is None:
                return
            entry.retries += 1
            self.retransmits += 1
            if entry.retries > self.max_retries:
                self._fail(
                    ChecksumError(
                        f"chunk {entry.header.chunk_index} of layer {entry.header.layer} failed its CRC at the "
                        f"receiver {entry.retries} times; giving up"
                    )
                )
                return
            resend = replace(entry.header, flags=entry.header.flags | Flag.RETRY)
            task = asyncio.get_running_loop().create_task(self._resend(resend, entry.payload, entry.deadline))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._fail(ProtocolError(f"{self.backend}: unexpected {msg.kind.name} message from the receiver"))

    async def _resend(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        try:
            await self._locked_transmit(header, payload, deadline)
        except (OSError, TransportError) as err:
            self._fail(err if isinstance(err, TransportError) else PeerClosedError(f"{self.backend}: {err}"))

    def _on_lost(self, why: str) -> None:
        """The connection ended; fail whatever is still unacknowledged."""
        if self._pending or not self._closed:
            pending = len(self._pending)
            why = f"{self.backend}: receiver went away ({why}) with {pending} chunk(s) unacknowledged"
            self._fail(PeerClosedError(why))

    def fail(self, err: TransportError) -> None:
        """Mark the channel broken: pending and later sends raise `err`."""
        self._fail(err)

    def _fail(self, err: TransportError) -> None:
        first = self._error is None
        if first:
            self._error = err
        for entry in self._pending.values():
            if not entry.acked.done():
                entry.acked.set_exception(self._error)
        self._pending.clear()
        if first:  # wake anyone waiting for a slot; they re-check `_error`
            for _ in range(self.max_inflight):
                self._slots.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _consume_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # mark retrieved: the error is raised from drain()/send()


class RecvChannel(ABC):
    """The receiving end of one connection."""

    backend: ClassVar[str]

    arena = None  # a SharedArena when the backend delivers straight into registered memory (shm)
    decodes_in_place: ClassVar[bool] = False  # True: `recv` takes a `decoder` (see `Decoder`)

    def __init__(self, *, max_retries: int = 2) -> None:
        self.max_retries = max_retries
        self.checksum_failures = 0
        self._failures: dict[tuple[str, int], int] = {}

    @abstractmethod
    async def recv(self, sink: Sink, deadline: float) -> ChunkHeader | None:
        """The next verified DATA chunk (its payload now in the view `sink` gave), or None
        when the sender closed the connection between messages. A corrupt chunk is NACKed
        and skipped (its resend arrives later); a truncated stream, an ABORT or a deadline
        raises."""

    @abstractmethod
    async def aclose(self) -> None: ...

    async def publish(self, request_id: str, regions: list[tuple[int, int]]) -> None:
        """Tell the sender where `request_id`'s layers lie in `arena` (zero-copy backends only)."""
        raise TransportError(f"{self.backend}: this backend does not deliver into registered memory")

    def _note_corrupt(self, header: ChunkHeader, err: ChecksumError) -> None:
        """Count a CRC failure; past `max_retries` for one chunk the transfer fails. Call it
        after sending the NACK, so the sender sees the last failure too and fails at once."""
        key = (header.request_id, header.seq)
        self.checksum_failures += 1
        self._failures[key] = self._failures.get(key, 0) + 1
        if self._failures[key] > self.max_retries:
            raise ChecksumError(f"{err} — still corrupt after {self.max_retries} resends") from None


class Listener(ABC):
    """Accepts connections; `address` is what a sender passes to `Backend.connect`."""

    address: str

    @abstractmethod
    async def accept(self, deadline: float) -> RecvChannel: ...

    @abstractmethod
    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Availability:
    name: str
    available: bool
    reason: str = ""


class Backend(ABC):
    name: ClassVar[str]
    description: ClassVar[str] = ""
    # True: listen() takes token / setup_timeout_s / on_refused and connect() takes token (auth.py)
    authenticates: ClassVar[bool] = False

    @classmethod
    def availability(cls) -> Availability:
        return Availability(cls.name, True)

    @abstractmethod
    async def listen(self, address: str | None = None, *, max_retries: int = 2) -> Listener: ...

    @abstractmethod
    async def connect(
        self, address: str, *, max_inflight: int = 8, max_retries: int = 2, timeout_s: float = 30.0
    ) -> SendChannel: ...


BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    BACKENDS[cls.name] = cls
    return cls


# Third-party engines: reported, imported only when installed. (package, module whose import proves the
# engine loads — mooncake's needs libibverbs even for TCP, description)
OPTIONAL_BACKENDS = {
    "mooncake": ("mooncake", "mooncake.engine", "Mooncake Transfer Engine (pip install mooncake-transfer-engine)"),
    "nixl": ("nixl", "nixl", "NVIDIA NIXL (pip install nixl)"),
}


def backend_availability() -> list[Availability]:
    """Every backend this build knows of, whether it can run here, and why not."""
    _load_builtin()
    out = [cls.availability() for cls in BACKENDS.values()]
    for name, (package, module, what) in OPTIONAL_BACKENDS.items():
        if importlib.util.find_spec(package) is None:
            out.append(Availability(name, False, f"{what} is not installed"))
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - a native library that does not load: say which
            out.append(Availability(name, False, f"{what} is installed but does not load: {err}"))
        else:
            out.append(Availability(name, False, f"{what} is installed, but sage has no adapter for it yet"))
    return out


def get_backend(name: str, **options) -> Backend:
    """A backend instance by name (`options` go to its constructor); unknown or unavailable
    names raise with the reason."""
    _load_builtin()
    cls = BACKENDS.get(name)
    if cls is None:
        why = dict((a.name, a.reason) for a in backend_availability()).get(name)
        if why:
            raise BackendUnavailable(f"transport backend {name!r} is not available: {why}")
        raise BackendUnavailable(f"unknown transport backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    status = cls.availability()
    if not status.available:
        raise BackendUnavailable(f"transport backend {name!r} is not available: {status.reason}")
    return cls(**options)


def _load_builtin() -> None:
    import sage_infer.transport.backends  # noqa: F401  (registers shm, tcp, torchdist)
