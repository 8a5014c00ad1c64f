"""`KVChunk` and `TransportPlan`: the units the KV transport engine moves."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype


@dataclass(frozen=True, slots=True)
class KVChunk:
    """A contiguous byte range of one request's KV for one layer.

    `offset`/`length` are bytes into the layer's serialized blocks; `crc32` covers
    exactly `length` payload bytes so a receiver can reject corrupt or truncated data.
    """

    request_id: str
    layer: int
    chunk_index: int
    offset: int
    length: int
    dtype: KVDtype
    block_ids: tuple[int, ...] = ()
    crc32: int | None = None
    is_last: bool = False

    def __post_init__(self) -> None:
        if self.layer < 0 or self.chunk_index < 0 or self.offset < 0 or self.length <= 0:
            raise ValueError(f"KVChunk has a negative index/offset or empty length: {self}")

    def verify(self, payload: bytes | memoryview) -> bool:
        """True when `payload` has the advertised length and checksum."""
        if len(payload) != self.length:
            return False
        return self.crc32 is None or zlib.crc32(payload) == self.crc32


@dataclass(frozen=True, slots=True)
class TransportPlan:
    """How one request's KV will move: which chunks, in what format, over what backend."""

    request_id: str
    source: str  # instance or tier, e.g. "prefill-0", "host"
    destination: str
    backend: str  # shm, tcp, torchdist, rdma
    schema: KVCacheSchema  # format at the source
    wire_dtype: KVDtype  # format on the wire (== schema.dtype when no conversion)
    chunks: tuple[KVChunk, ...] = field(default_factory=tuple)
    deadline_s: float = 30.0

    @property
    def total_bytes(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    @property
    def converts(self) -> bool:
        return self.wire_dtype is not self.schema.dtype

    @staticmethod
    def split(request_id: str, layer: int, nbytes: int, chunk_size: int, dtype: KVDtype) -> list[KVChunk]:
        """Cut `nbytes` of one layer into chunks of at most `chunk_size` bytes."""
        if nbytes <= 0 or chunk_size <= 0:
            raise ValueError("nbytes and chunk_size must be > 0")
        count = (nbytes + chunk_size - 1) // chunk_size
        return [
            KVChunk(
                request_id=request_id,
                layer=layer,
                chunk_index=i,
                offset=i * chunk_size,
                length=min(chunk_size, nbytes - i * chunk_size),
                dtype=dtype,
                is_last=i == count - 1,
            )
            for i in range(count)
        ]
