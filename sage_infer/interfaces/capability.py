"""What a device and a backend can do, as hal and backends report it."""

from __future__ import annotations

from dataclasses import dataclass, field

from sage_infer.core.kv_schema import KVDtype


@dataclass(frozen=True, slots=True)
class LinkDescriptor:
    """A path from one device to a peer (another device, the host or a NIC)."""

    peer: str  # "device:3", "host", "nic:mlx5_0"
    link_class: str  # a hal LinkClass value: nvlink, hccs, pcie-sys, ...
    bandwidth_gb_s: float | None = None  # per direction; None when unknown


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
    links: tuple[LinkDescriptor, ...] = ()
    dma_alignment_bytes: int = 64
    numa_node: int | None = None
    driver_version: str | None = None

    @property
    def torch_device(self) -> str:
        return self.device_type if self.device_type == "cpu" else f"{self.device_type}:{self.index}"


@dataclass(frozen=True, slots=True)
class CapabilityDescriptor:
    """What an inference backend offers on the devices it runs on."""

    backend: str
    devices: tuple[AcceleratorDescriptor, ...]
    kv_dtypes: tuple[KVDtype, ...]
    max_model_len: int | None = None
    supports_prefix_caching: bool = False
    supports_chunked_prefill: bool = False
    supports_kv_transfer: bool = False
    features: frozenset[str] = field(default_factory=frozenset)
