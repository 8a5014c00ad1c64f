"""The disk tier's on-disk format: append-only segment files of self-describing records.

One record = a 72-byte little-endian header + the block's payload bytes:

    offset size field
    0      4    magic          b"SKV1" live, b"SKV0" deleted (rewritten in place by a delete)
    4      2    version        1
    6      2    header_size    72 (lets a later version grow the header)
    8      16   schema digest  `base.schema_digest(schema)`: records of another schema are skipped
    24     32   block hash     the key (chained sha256)
    56     8    payload length bytes_per_block
    64     4    payload CRC32C
    68     4    header CRC32C  over bytes 4..68 (not the magic, so a delete keeps the header valid)

A segment is a file ``<id:08d>.seg`` filled front to back and never rewritten except for
the magic of a deleted record. Nothing else is stored: the index is rebuilt from the
headers at start-up, so a restarted server finds what it wrote before.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np
import torch

from sage_infer.kv_runtime.tiers.rows import crc_rows, fused_kernel

MAGIC_LIVE = b"SKV1"
MAGIC_DEAD = b"SKV0"
VERSION = 1
HEADER = struct.Struct("<4sHH16s32sQII")
# the same header as a numpy record, to fill a batch's headers at once
HEADER_DTYPE = np.dtype([("magic", "S4"), ("version", "<u2"), ("header_size", "<u2"), ("digest", "S16"),
                         ("key", "S32"), ("length", "<u8"), ("crc", "<u4"), ("header_crc", "<u4")])
SUFFIX = ".seg"


def encode_header(digest: bytes, key: bytes, length: int, payload_crc: int) -> bytes:
    body = struct.pack("<HH16s32sQI", VERSION, HEADER.size, digest, key, length, payload_crc)
    return MAGIC_LIVE + body + struct.pack("<I", crc32c.crc32c(body))


def encode_headers(records: torch.Tensor, digest: bytes, keys: list[bytes], length: int,
                   payload_crcs: np.ndarray) -> None:
    """`encode_header` of every record of a batch at once, into the first `HEADER.size` bytes of each row of
    ``records: [n, >= HEADER.size]`` uint8 (rows contiguous): numpy fills the fields, and the header CRC32Cs are
    one kernel call for the batch where the one-pass kernel loads (else `crc32c` per row)."""
    n = len(keys)
    heads = records[:, : HEADER.size].numpy().view(HEADER_DTYPE)[:, 0]
    heads["magic"] = MAGIC_LIVE
    heads["version"] = VERSION
    heads["header_size"] = HEADER.size
    heads["digest"] = digest
    heads["key"] = np.frombuffer(b"".join(keys), dtype="S32", count=n)
    heads["length"] = length
    heads["crc"] = payload_crcs
    body = records[:, 4 : HEADER.size - 4]  # what the header CRC covers (not the magic, so a delete keeps it)
    kernel = fused_kernel()
    if kernel is not None:
        scratch = torch.empty(body.shape, dtype=torch.uint8)
        heads["header_crc"] = kernel.copy_rows_crc32c(scratch, body, torch.tensor([[0, 0, n]])).numpy()
    else:
        heads["header_crc"] = crc_rows(body.numpy())


@dataclass(slots=True)
class Record:
    """One parsed header; `offset` is where its header starts in the segment."""

    offset: int
    live: bool
    digest: bytes
    key: bytes
    length: int
    crc: int

    @property
    def payload_offset(self) -> int:
        return self.offset + HEADER.size

    @property
    def size(self) -> int:
        return HEADER.size + self.length


def decode_header(data: bytes, offset: int) -> Record | None:
    """The record whose header is `data` (HEADER.size bytes), or None if it is torn or not ours."""
    if len(data) != HEADER.size:
        return None
    magic, version, header_size, digest, key, length, payload_crc, header_crc = HEADER.unpack(data)
    if magic not in (MAGIC_LIVE, MAGIC_DEAD) or version != VERSION or header_size != HEADER.size:
        return None
    if crc32c.crc32c(data[4:-4]) != header_crc:
        return None
    return Record(offset, magic == MAGIC_LIVE, digest, key, length, payload_crc)


@dataclass(slots=True, eq=False)
class Segment:
    """One open segment file. `readers` pins the fd while a read is in flight outside the tier lock."""

    id: int
    path: Path
    fd: int
    size: int = 0  # bytes written (the next record goes here)
    dead_bytes: int = 0  # deleted, evicted, superseded, foreign or torn records
    keys: set[bytes] = field(default_factory=set)  # live keys whose record is here
    readers: int = 0
    doomed: bool = False  # evicted or compacted away: close the fd when the last reader leaves

    @classmethod
    def create(cls, directory: Path, seg_id: int) -> Segment:
        path = directory / f"{seg_id:08d}{SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        return cls(seg_id, path, fd)

    @classmethod
    def open(cls, path: Path) -> Segment:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        return cls(int(path.stem), path, fd, size=os.fstat(fd).st_size)

    def records(self) -> Iterator[Record]:
        """Every well-formed record front to back; stops at the first torn one (counted as dead bytes)."""
        offset = 0
        while offset < self.size:
            record = decode_header(os.pread(self.fd, HEADER.size, offset), offset)
            if record is None or offset + record.size > self.size:  # a write cut short by a crash
                self.dead_bytes += self.size - offset
                yield Record(offset, False, b"", b"", -1, 0)  # marks "torn" for the caller's count
                return
            yield record
            offset += record.size

    def mark_dead(self, record_offset: int) -> None:
        """Rewrite a record's magic so a restart does not bring a deleted block back."""
        os.pwrite(self.fd, MAGIC_DEAD, record_offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def segment_paths(directory: Path) -> list[Path]:
    """Segment files oldest first (ids grow with time)."""
    return sorted(p for p in directory.glob(f"*{SUFFIX}") if p.stem.isdigit())
