"""A device as hal reports it."""

from __future__ import annotations

from dataclasses import dataclass

from sage_infer.core.kv_schema import KVDtype


@dataclass(frozen=True, slots=True)
class AcceleratorDescriptor:
    """One device found on this machine (or the host CPU, with vendor ``cpu``).

    `torch_device` is the string torch takes (``"cuda:0"``, ``"npu:1"``, ``"cpu"``).
    """

    vendor: str
    device_type: str  # torch device type: cpu, cuda, npu, mlu, xpu
    index: int
    name: str
    memory_bytes: int
    kv_dtypes: tuple[KVDtype, ...]
    dma_alignment_bytes: int = 64
    numa_node: int | None = None
    driver_version: str | None = None

    @property
    def torch_device(self) -> str:
        return self.device_type if self.device_type == "cpu" else f"{self.device_type}:{self.index}"
