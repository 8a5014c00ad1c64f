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
transfer, so a receiver knows when it is complete. The header CRC covers the 124
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

from sage_infer.transport.errors import ChecksumError, ProtocolError

MAGIC = b"SKVT"
VERSION = 2  # 2: AUTH opens every shm/tcp connection
_FORMAT = struct.Struct("<4sBBHBBBBIIQQQQIIQII48s")
HEADER_BYTES = _FORMAT.size + 4
assert HEADER_BYTES == 128, HEADER_BYTES
MAX_REQUEST_ID = 48


class Kind(enum.IntEnum):
    DATA = 1
    ACK = 2  # chunk `seq` arrived and verified
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


def checksum(data, algorithm: Checksum = Checksum.CRC32C, value: int = 0) -> int:
    """CRC of a bytes-like object (bytes, memoryview, numpy array), unsigned 32-bit;
    `value` continues a CRC over earlier bytes."""
    if algorithm is Checksum.CRC32C:
        return _crc32c.crc32c(data, value)
    if algorithm is Checksum.NONE:
        return 0
    return zlib.crc32(data, value)


@dataclass(frozen=True, slots=True)
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

    def pack(self) -> bytes:
        rid = self.request_id.encode()
        if len(rid) > MAX_REQUEST_ID:
            raise ValueError(f"request id is {len(rid)} bytes; the wire header holds at most {MAX_REQUEST_ID}")
        body = _FORMAT.pack(
            MAGIC, VERSION, int(self.kind), int(self.flags),
            DTYPE_CODES[self.wire_dtype], DTYPE_CODES[self.src_dtype],
            GRANULARITIES.index(self.granularity), int(self.algorithm),
            self.layer, self.chunk_index, self.seq, self.offset, self.length, self.raw_length,
            self.cols, self.group_size, self.slot, self.count, self.crc, rid,
        )  # fmt: skip
        return body + zlib.crc32(body).to_bytes(4, "little")

    @classmethod
    def unpack(cls, data) -> ChunkHeader:
        """Parse and check one header; a bad magic/version/CRC raises with what was wrong."""
        data = bytes(data)
        if len(data) != HEADER_BYTES:
            raise ProtocolError(f"header is {len(data)} bytes, expected {HEADER_BYTES}")
        if data[:4] != MAGIC:
            raise ProtocolError(f"bad magic {data[:4]!r} (not a sage KV transport stream)")
        body, crc = data[:-4], int.from_bytes(data[-4:], "little")
        if zlib.crc32(body) != crc:
            raise ChecksumError("chunk header failed its CRC (corrupt header)")
        fields = _FORMAT.unpack(body)
        magic, version, kind, flags, wire, src, gran, algo = fields[:8]
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r} (not a sage KV transport stream)")
        if version != VERSION:
            raise ProtocolError(f"wire version {version} is not supported (this side speaks {VERSION})")
        try:
            return cls(
                kind=Kind(kind), flags=Flag(flags), wire_dtype=DTYPE_NAMES[wire], src_dtype=DTYPE_NAMES[src],
                granularity=GRANULARITIES[gran], algorithm=Checksum(algo),
                layer=fields[8], chunk_index=fields[9], seq=fields[10], offset=fields[11], length=fields[12],
                raw_length=fields[13], cols=fields[14], group_size=fields[15], slot=fields[16], count=fields[17],
                crc=fields[18], request_id=fields[19].rstrip(b"\0").decode(),
            )  # fmt: skip
        except (ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
            raise ProtocolError(f"malformed header field: {err}") from None

    def reply(self, kind: Kind) -> ChunkHeader:
        """An ACK/NACK for this chunk: same identity, no payload."""
        return replace(self, kind=kind, length=0, raw_length=0, crc=0)

    def verify(self, payload) -> None:
        """Raise `ChecksumError` unless `payload` is this chunk's bytes (nothing to check without a checksum)."""
        if self.algorithm is Checksum.NONE:
            return
        got = checksum(payload, self.algorithm)
        if got != self.crc:
            raise ChecksumError(
                f"chunk {self.chunk_index} of layer {self.layer} (request {self.request_id!r}) failed its CRC: "
                f"got {got:#010x}, header says {self.crc:#010x}"
            )
