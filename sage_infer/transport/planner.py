"""`TransferPlanner`: backend, chunk size, in-flight depth and wire dtype for one transfer.

Starts from the resolved `KVTransportConfig` (what the operator asked for) and the
`HardwareProfile` (what the machine can do), and says why it chose each value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sage_infer.config.hardware import HardwareProfile
from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.dtypes import TORCH_DTYPES
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.interfaces.transport import KVChunk, TransportPlan

MIB = 1024 * 1024
# On a CPU loopback the per-chunk cost (a syscall, a wake-up, an ACK) is tens of µs:
# below 1 MiB it starts to show; above 4 MiB the pipeline has too few chunks to overlap.
CPU_CHUNK_RANGE = (1 * MIB, 4 * MIB)

SLOW_LINK_GB_S = 4.0  # below this per host, converting KV on the wire saves more time than it costs

# Unquantized KV dtypes by wire name ("fp16") and back: the pool's own mapping, not a second one.
TORCH_OF = {kv.value: dtype for kv, dtype in TORCH_DTYPES.items()}
WIRE_NAMES = {dtype: name for name, dtype in TORCH_OF.items()}


def wire_name(dtype: torch.dtype) -> str:
    """The wire-header name of a tensor dtype (anything not float is sent as raw bytes)."""
    return WIRE_NAMES.get(dtype, "raw")


@dataclass(frozen=True, slots=True)
class PlannedTransfer:
    backend: str
    chunk_bytes: int
    max_inflight: int
    wire_dtype: str | None  # None: as stored
    granularity: str = "per_token"
    reasons: list[str] = field(default_factory=list)


class TransferPlanner:
    def __init__(self, config: KVTransportConfig | None = None, hardware: HardwareProfile | None = None) -> None:
        self.config = config or KVTransportConfig()
        self.hardware = hardware

    def choose(self, *, same_host: bool = True, device_type: str = "cpu", row_bytes: int = 1) -> PlannedTransfer:
        cfg = self.config
        reasons: list[str] = []
        backend = cfg.backend
        if backend == "auto":
            preferred = list(self.hardware.transport.backends) if self.hardware else ["shm", "tcp"]
            if device_type != "cpu" and "torchdist" in preferred:
                backend = "torchdist"
                reasons.append(f"KV lives on {device_type}: device-to-device point-to-point (torch.distributed)")
            elif same_host:
                backend = "shm"
                reasons.append("same host: shared-memory ring")
            else:
                backend = "tcp"
                reasons.append("another host: TCP")
        else:
            reasons.append(f"backend {backend} set in the transport config")
        if backend == "rdma":
            raise NotImplementedError("the rdma transport backend is not implemented; use shm, tcp or torchdist")
        chunk = int(cfg.chunk_size)
        loopback = device_type == "cpu" and backend in ("shm", "tcp")
        low, high = CPU_CHUNK_RANGE
        if "chunk_size" in cfg.model_fields_set:
            reasons.append(f"chunk size {chunk // 1024} KiB set in the transport config")
            if loopback and not low <= chunk <= high:
                reasons.append("note: outside the 1-4 MiB range that suits a CPU loopback")
        elif self.hardware is not None:
            # About 1 ms of the link's bandwidth: the fixed per-chunk overhead (bench/shm_chunk_cost.py) stays
            # a small share.
            link = self.hardware.memory.bandwidth_gb_s if loopback else self.hardware.host_link.bandwidth_gb_s
            chunk = 1 << max(12, int(link * 1e6).bit_length() - 1)
            reasons.append(f"~1 ms of {link:g} GB/s: {chunk // 1024} KiB chunks")
        if loopback and "chunk_size" not in cfg.model_fields_set and not low <= chunk <= high:
            clamped = min(max(chunk, low), high)
            reasons.append(f"chunk {chunk // 1024} KiB clamped to {clamped // 1024} KiB for a CPU loopback")
            chunk = clamped
        align = row_bytes * 2  # whole rows, and an even element count for int4 packing
        if self.hardware:
            align = math.lcm(align, self.hardware.transport.dma_alignment_bytes)
        chunk = max(align, chunk // align * align)
        return PlannedTransfer(backend, chunk, cfg.max_inflight, self._wire_dtype(same_host, reasons), reasons=reasons)

    def _wire_dtype(self, same_host: bool, reasons: list[str]) -> str | None:
        """The config's `target_dtype`, else fp8/int8 across hosts whose NICs are slower than
        the converter (`SLOW_LINK_GB_S`; bench/kv_convert.py measures the converter), else as stored."""
        if self.config.target_dtype is not None:
            reasons.append(f"wire dtype {self.config.target_dtype} set in the transport config")
            return self.config.target_dtype
        if same_host or self.hardware is None or not self.hardware.inter_node_nics:
            return None
        nic_gb_s = sum(n.count * n.gbit_s for n in self.hardware.inter_node_nics) / 8
        if nic_gb_s >= SLOW_LINK_GB_S:
            return None
        supported = [d.value for d in self.hardware.kv.dtypes]
        for candidate in ("fp8_e4m3", "int8"):
            if candidate in supported:
                reasons.append(f"NICs give {nic_gb_s:g} GB/s, below {SLOW_LINK_GB_S:g}: {candidate} halves the bytes")
                return candidate
        return None

    def plan(
        self,
        request_id: str,
        layers: Sequence[torch.Tensor],
        *,
        schema: KVCacheSchema | None = None,
        source: str = "local",
        destination: str = "peer",
        same_host: bool = True,
    ) -> tuple[TransportPlan, PlannedTransfer]:
        """Chunks for every layer of one request's KV (each layer one contiguous tensor whose
        last dim is head_dim, e.g. ``[2, tokens, kv_heads, head_dim]``)."""
        if not layers:
            raise ValueError("a transfer needs at least one layer")
        first = layers[0]
        if first.dtype not in WIRE_NAMES:
            raise ValueError(f"KV tensors must be fp32/fp16/bf16 to plan a transfer, got {first.dtype}")
        kv_dtype = KVDtype(wire_name(first.dtype))
        if schema is None:
            heads = first.shape[-2] if first.dim() >= 2 else 1
            schema = KVCacheSchema(num_layers=len(layers), num_kv_heads=heads, head_dim=first.shape[-1], dtype=kv_dtype)
        row_bytes = first.shape[-1] * first.element_size()
        choice = self.choose(same_host=same_host, device_type=first.device.type, row_bytes=row_bytes)
        chunks: list[KVChunk] = []
        for layer, tensor in enumerate(layers):
            if not tensor.is_contiguous() or tensor.dtype != first.dtype or tensor.shape[-1] != first.shape[-1]:
                raise ValueError(f"layer {layer}: KV tensors must be contiguous with one dtype and head_dim")
            nbytes = tensor.numel() * tensor.element_size()
            chunks += TransportPlan.split(request_id, layer, nbytes, choice.chunk_bytes, kv_dtype)
        wire = KVDtype(choice.wire_dtype) if choice.wire_dtype else kv_dtype
        plan = TransportPlan(request_id, source, destination, choice.backend, schema, wire, tuple(chunks),
                             deadline_s=self.config.timeout_s)
        return plan, choice
