"""`KVReceiveBuffers`: where received chunks land, and which of them are verified."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from sage_infer.transport.arena import SharedArena
from sage_infer.transport.format import converter
from sage_infer.transport.planner import TORCH_OF
from sage_infer.transport.transport_errors import ProtocolError
from sage_infer.transport.wire import ChunkHeader


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    if not tensor.is_contiguous():
        raise ValueError("KV tensors must be contiguous to be sent or received in place")
    return tensor.reshape(-1).view(torch.uint8)


def host_view(u8: torch.Tensor) -> memoryview:
    if u8.device.type != "cpu":  # socket/shm backends stage device KV through host memory
        u8 = u8.to("cpu")
    return memoryview(u8.numpy())


class KVReceiveBuffers:
    """Destination tensors registered per request; tracks which chunks are verified in place."""

    def __init__(self) -> None:
        self._layers: dict[str, list[torch.Tensor]] = {}
        self._bytes: dict[str, list[torch.Tensor]] = {}
        self._arrays: dict[str, list] = {}  # the same bytes as numpy arrays (host layers): cheap per-chunk slices
        self._done: dict[str, set[int]] = {}
        self._expected: dict[str, int] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._decoded: dict[tuple[str, int], float] = {}  # chunks decode_from put in place: their decode seconds

    def register(self, request_id: str, layers: Sequence[torch.Tensor]) -> None:
        self._layers[request_id] = list(layers)
        self._bytes[request_id] = [as_bytes(t) for t in layers]
        self._arrays[request_id] = [b.numpy() if b.device.type == "cpu" else None for b in self._bytes[request_id]]
        self._done[request_id] = set()
        self._expected.pop(request_id, None)

    def release(self, request_id: str) -> None:
        for table in (self._layers, self._bytes, self._arrays, self._done, self._expected):
            table.pop(request_id, None)
        if self._decoded:  # (a chunk decoded in place whose CRC failed, never landed)
            self._decoded = {key: s for key, s in self._decoded.items() if key[0] != request_id}

    def sink(self, header: ChunkHeader) -> memoryview:
        """Where this chunk's payload goes: straight into the layer, or a staging buffer
        when it must be decoded first."""
        if header.request_id not in self._bytes:
            raise ProtocolError(f"no receive buffers registered for request {header.request_id!r}")
        if header.converted:
            self._check_encoded_size(header)
            if self._staging.numel() < header.length:
                self._staging = torch.empty(header.length, dtype=torch.uint8)
            return memoryview(self._staging[: header.length].numpy())
        arrays = self._arrays[header.request_id]
        end = header.offset + header.length
        if header.layer < len(arrays) and arrays[header.layer] is not None and end <= len(arrays[header.layer]):
            return memoryview(arrays[header.layer][header.offset : end])  # the common case, without torch slicing
        return memoryview(self._region(header, header.length).numpy())  # raises with what does not fit

    def decode_from(self, header: ChunkHeader, payload) -> int | None:
        """Decode a converted chunk straight from `payload` (its wire bytes where the channel holds them, e.g. the
        shm ring) into its destination, and return the payload's CRC32C taken in that pass: one read of the chunk
        instead of a copy into staging, a CRC and a decode. None, with nothing written, where the kernel does not
        run or the chunk has no registered destination: the caller lands it through `sink` and `land`. Like any
        chunk, it counts as delivered only once `land` runs after its CRC checked out."""
        arrays = self._arrays.get(header.request_id)
        if not header.converted or arrays is None or header.layer >= len(arrays) or arrays[header.layer] is None:
            return None
        self._check_encoded_size(header)
        out = self._region(header, header.raw_length).view(TORCH_OF[header.src_dtype]).view(-1, header.cols)
        start = time.perf_counter()
        crc = converter.decode_checksummed(torch.from_numpy(np.asarray(payload)), header.wire_dtype, out,
                                           header.granularity, header.group_size or None)
        if crc is not None:
            self._decoded[(header.request_id, header.seq)] = time.perf_counter() - start
        return crc

    def _check_encoded_size(self, header: ChunkHeader) -> None:
        """A converted chunk must decode into its destination exactly: checked before any
        staging memory is sized from what the peer claims."""
        region = self._region(header, header.raw_length)
        dtype = TORCH_OF.get(header.src_dtype)
        row = header.cols * (dtype.itemsize if dtype is not None else 0)
        if dtype is None or row == 0 or region.numel() % row:
            raise ProtocolError(f"converted chunk {header.chunk_index}: {header.raw_length} bytes of "
                                f"{header.src_dtype} do not form rows of {header.cols} values")
        try:
            expected = converter.encoded_nbytes(header.wire_dtype, region.numel() // row, header.cols,
                                                header.granularity, header.group_size or None)
        except ValueError as err:
            raise ProtocolError(f"converted chunk {header.chunk_index}: {err}") from None
        if header.length != expected:
            raise ProtocolError(f"converted chunk {header.chunk_index} carries {header.length} bytes; "
                                f"{header.wire_dtype} of that shape is {expected}")

    def _region(self, header: ChunkHeader, length: int) -> torch.Tensor:
        layers = self._bytes[header.request_id]
        if header.layer >= len(layers):
            raise ProtocolError(f"chunk for layer {header.layer}, but request {header.request_id!r} has {len(layers)}")
        dest = layers[header.layer]
        if header.offset + length > dest.numel():
            raise ProtocolError(
                f"chunk {header.chunk_index} of layer {header.layer} ends at byte {header.offset + length}, "
                f"past the {dest.numel()}-byte destination"
            )
        return dest[header.offset : header.offset + length]

    def land(self, header: ChunkHeader) -> float:
        """Decode a verified converted chunk into place (returns seconds spent); mark it delivered."""
        decoded = self._decoded.pop((header.request_id, header.seq), None)
        spent = decoded or 0.0
        if decoded is None and header.converted:
            start = time.perf_counter()
            region = self._region(header, header.raw_length)
            dtype = TORCH_OF[header.src_dtype]
            out = region.view(dtype).view(-1, header.cols)
            converter.decode(self._staging[: header.length], header.wire_dtype, out.shape[0], header.cols, dtype,
                             header.granularity, header.group_size or None, out=out)
            spent = time.perf_counter() - start
        self._expected[header.request_id] = header.count
        self._done[header.request_id].add(header.seq)
        return spent

    def placement(self, request_id: str, arena: SharedArena) -> list[tuple[int, int]] | None:
        """(arena offset, bytes) of every layer of `request_id`, or None unless all live in `arena`."""
        regions = []
        for layer in self._bytes.get(request_id, ()):
            offset = arena.offset_of(layer)
            if offset is None:
                return None
            regions.append((offset, layer.numel()))
        return regions or None

    def delivered(self, request_id: str) -> int:
        return len(self._done.get(request_id, ()))

    def complete(self, request_id: str) -> bool:
        expected = self._expected.get(request_id)
        return expected is not None and len(self._done[request_id]) >= expected

    def invalidate(self, request_id: str) -> None:
        """Forget every delivered chunk of a failed transfer: none of its bytes may be used."""
        if request_id in self._done:
            self._done[request_id].clear()
            self._expected.pop(request_id, None)
