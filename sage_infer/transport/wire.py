"""The fixed binary header every chunk and control message carries on every wire.

128 bytes, little-endian, no pickle, no variable-length fields, so a receiver can
read exactly one header, check it, and then read exactly `length` payload bytes
straight into the buffer registered for (request, layer, offset)::

    magic "SKVT" | version u8 | kind u8 | flags u16 | wire_dtype u8 | src_dtype u8
    granularity u8 | checksum algorithm u8 | layer u32 | chunk_index u32
    seq u64 | offset u64 | length u64 | raw_length u64
    cols u32 | group_size u32 | slot u64 | count u32 | payload crc u32
    request_id 48 bytes (utf-8, NUL padded) | header crc u32

`length` is the payload on the wire; `raw_length` its size after the receiver undoes
a format conversion (equal when none). `count` is the number of chunks in the whole
transfer, so a receiver knows when it is complete; in an ACK it is the number of
consecutive sequence numbers the ACK covers, ending at `seq` (a receiver may acknowledge
a run of verified chunks with one message). The header CRC covers the 124
bytes before it: a flipped bit in a length or offset is caught before any payload
is read. Control messages (ACK, NACK, HELLO, ABORT, PLACE, AUTH) reuse the same header; only PLACE and
AUTH have a payload.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, replace

import crc32c as _crc32c
import numpy as np

from sage_infer.quantization.kv_codec_kernel import crc32c_array
from sage_infer.transport.transport_errors import ChecksumError, ProtocolError

MAGIC = b"SKVT"
VERSION = 3  # 2: AUTH opens every shm/tcp connection; an ACK covers `count` sequence numbers; 3: converted
# payloads are the KV pool codec's (fp16 scales, symmetric: no mins)
_FORMAT = struct.Struct("<4sBBHBBBBIIQQQQIIQII48s")
HEADER_BYTES = _FORMAT.size + 4
assert HEADER_BYTES == 128, HEADER_BYTES
MAX_REQUEST_ID = 48
KERNEL_CRC_MIN_BYTES = 64 << 10  # shorter payloads: the package's call costs less than the tensor wrapping


class Kind(enum.IntEnum):
    DATA = 1
    ACK = 2  # chunks `seq - count + 1` .. `seq` arrived and verified
    NACK = 3  # chunk `seq` failed its checksum: send it again
    HELLO = 4  # connection set-up (backend-specific fields)
    ABORT = 5  # the sender gives up on transfer `request_id`
    PLACE = 6  # receiver -> sender: where each layer of `request_id` lives in the shared arena (payload)
    AUTH = 7  # connection set-up: the shared-token challenge, answer and proof (auth.py; payload)


class Flag(enum.IntFlag):
    NONE = 0
    LAST = 1  # last chunk of its layer
    CONVERTED = 2  # payload is in `wire_dtype`; decode to `src_dtype`
    RETRY = 4  # a resend after a NACK
    DIRECT = 8  # written by the sender straight into the receiver's registered buffer (shm arena offset in `slot`)
    ACK_NOW = 16  # the sender waits for acknowledgements after this chunk: do not hold its ACK back

    # Both ends test and set flags several times a chunk, and enum's own `&` and `|` build each result through the
    # enum machinery (about 2 µs apiece on the VMs measured): a test (`&`) gives the plain int, at int's speed;
    # setting (`|`) looks the member up
    __and__ = __rand__ = int.__and__

    def __or__(self, other: int) -> Flag:
        return _flag(int.__or__(self, other))

    __ror__ = __or__


class Checksum(enum.IntEnum):
    NONE = 0  # no payload checksum (kv_transport.checksum: none); a receiver accepts it only when it allows none
    CRC32C = 1  # Castagnoli, hardware-accelerated (SSE4.2 / ARMv8 CRC) through the crc32c package
    CRC32 = 2  # IEEE (zlib), for peers without crc32c


# Codes of the formats a payload can be in (KV dtypes and the converter's wire formats).
DTYPE_CODES = {
    "raw": 0,
    "fp32": 1,
    "fp16": 2,
    "bf16": 3,
    "fp8_e4m3": 4,
    "fp8_e5m2": 5,
    "fp8_e4m3fnuz": 6,
    "int8": 7,
    "int4": 8,
}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
GRANULARITIES = ("per_token", "per_channel")
# Wire code -> member, looked up once per message instead of calling the enum (unpack is per chunk).
_KINDS = {int(k): k for k in Kind}
_FLAGS = {bits: Flag(bits) for bits in range(1 << len(Flag))}
_CHECKSUMS = {int(c): c for c in Checksum}


def _flag(bits: int) -> Flag:
    flag = _FLAGS.get(bits)
    return flag if flag is not None else Flag(bits)


def _ack_body(seq: int, count: int) -> bytes:
    body = _FORMAT.pack(MAGIC, VERSION, Kind.ACK, 0, 0, 0, 0, 0, 0, 0, seq, 0, 0, 0, 0, 0, 0, count, 0, b"")
    return body + zlib.crc32(body).to_bytes(4, "little")


def checksum(data, algorithm: Checksum = Checksum.CRC32C, value: int = 0) -> int:
    """CRC of a bytes-like object (bytes, memoryview, numpy array), unsigned 32-bit;
    `value` continues a CRC over earlier bytes. A long CRC32C runs on the CPU kernels' folding loop where it
    loads (about twice the `crc32c` package's rate), else on the package."""
    if algorithm is Checksum.CRC32C:
        if len(data) >= KERNEL_CRC_MIN_BYTES:
            got = crc32c_array(np.frombuffer(data, dtype=np.uint8), value)
            if got is not None:
                return got
        return _crc32c.crc32c(data, value)
    if algorithm is Checksum.NONE:
        return 0
    return zlib.crc32(data, value)


# Not frozen, though nothing changes a header once made: a frozen dataclass sets each of its 18 fields through
# object.__setattr__, which tripled the cost of the header each chunk builds on either side
@dataclass(slots=True)
class ChunkHeader:
    kind: Kind
    request_id: str
    seq: int = 0
    layer: int = 0
    chunk_index: int = 0
    offset: int = 0
    length: int = 0
    raw_length: int = 0
    count: int = 0
    flags: Flag = Flag.NONE
    wire_dtype: str = "raw"
    src_dtype: str = "raw"
    granularity: str = "per_token"
    cols: int = 0
    group_size: int = 0
    slot: int = 0
    crc: int = 0
    algorithm: Checksum = Checksum.CRC32C

    @property
    def converted(self) -> bool:
        return bool(self.flags & Flag.CONVERTED)

    def pack(self, *, slot: int | None = None, crc: int | None = None, flags: Flag | None = None) -> bytes:
        """The 128 wire bytes. `slot`, `crc` and `flags` override this header's: a channel that stages the
        payload fills in where it lies and its CRC as it packs, without building another header."""
        rid = self.request_id.encode()
        if len(rid) > MAX_REQUEST_ID:
            raise ValueError(f"request id is {len(rid)} bytes; the wire header holds at most {MAX_REQUEST_ID}")
        body = _FORMAT.pack(
            MAGIC, VERSION, int(self.kind), int(self.flags if flags is None else flags),
            DTYPE_CODES[self.wire_dtype], DTYPE_CODES[self.src_dtype],
            GRANULARITIES.index(self.granularity), int(self.algorithm),
            self.layer, self.chunk_index, self.seq, self.offset, self.length, self.raw_length,
            self.cols, self.group_size, self.slot if slot is None else slot, self.count,
            self.crc if crc is None else crc, rid,
        )  # fmt: skip
        return body + zlib.crc32(body).to_bytes(4, "little")

    @classmethod
    def unpack(cls, data) -> ChunkHeader:
        """Parse and check one header (any buffer of `HEADER_BYTES`); a bad magic/version/CRC raises with
        what was wrong."""
        if len(data) != HEADER_BYTES:
            raise ProtocolError(f"header is {len(data)} bytes, expected {HEADER_BYTES}")
        fields = _FORMAT.unpack_from(data)
        magic, version, kind, flags, wire, src, gran, algo = fields[:8]
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r} (not a sage KV transport stream)")
        if zlib.crc32(memoryview(data)[:-4]) != int.from_bytes(data[-4:], "little"):
            raise ChecksumError("chunk header failed its CRC (corrupt header)")
        if version != VERSION:
            raise ProtocolError(f"wire version {version} is not supported (this side speaks {VERSION})")
        try:
            flag = _FLAGS[flags] if flags in _FLAGS else Flag(flags)
            return cls(
                _KINDS[kind], fields[19].rstrip(b"\0").decode(), fields[10], fields[8], fields[9], fields[11],
                fields[12], fields[13], fields[17], flag, DTYPE_NAMES[wire], DTYPE_NAMES[src], GRANULARITIES[gran],
                fields[14], fields[15], fields[16], fields[18], _CHECKSUMS[algo],
            )  # positional, in field order: this runs once per chunk and per ACK
        except (ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
            raise ProtocolError(f"malformed header field: {err}") from None

    def reply(self, kind: Kind) -> ChunkHeader:
        """An ACK/NACK for this chunk alone: same identity, no payload."""
        return replace(self, kind=kind, length=0, raw_length=0, crc=0, count=1)

    @staticmethod
    def ack(first_seq: int, last_seq: int) -> bytes:
        """The packed ACK of the verified run `first_seq` .. `last_seq` (consecutive sequence numbers)."""
        return _ack_body(last_seq, last_seq - first_seq + 1)

    def verify(self, payload, got: int | None = None) -> None:
        """Raise `ChecksumError` unless `payload` is this chunk's bytes (nothing to check without a checksum);
        `got`: its checksum where the caller took it already (as it copied the bytes)."""
        if self.algorithm is Checksum.NONE:
            return
        if got is None:
            got = checksum(payload, self.algorithm)
        if got != self.crc:
            raise ChecksumError(
                f"chunk {self.chunk_index} of layer {self.layer} (request {self.request_id!r}) failed its CRC: "
                f"got {got:#010x}, header says {self.crc:#010x}"
            )
