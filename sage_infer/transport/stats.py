"""`TransferRecord` (what one transfer did) and `Priority` (who goes first)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Priority(enum.IntEnum):
    """Lower goes first."""

    DECODE = 0  # a decode step is waiting for this KV
    PREFILL = 5
    PREFETCH = 10  # bulk, speculative


@dataclass(slots=True)
class TransferRecord:
    """What one transfer of one request's KV did: its chunks, bytes (as stored and on the wire), time,
    retransmits and each chunk's round trip."""

    request_id: str
    backend: str
    direction: str  # send / recv
    chunks: int = 0
    bytes: int = 0  # KV bytes as stored
    wire_bytes: int = 0  # bytes on the wire (smaller when converted)
    seconds: float = 0.0
    convert_seconds: float = 0.0
    retransmits: int = 0
    chunk_seconds: list[float] = field(default_factory=list)  # send → verified ACK, per chunk

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def chunk_us(self, q: float) -> float:
        return float(np.quantile(self.chunk_seconds, q)) * 1e6 if self.chunk_seconds else 0.0
