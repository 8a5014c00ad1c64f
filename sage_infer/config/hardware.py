"""`HardwareProfile`: what one accelerator node offers, as a hardware preset states it.

A hardware preset (``presets/hardware/*.yaml``) is a `HardwareProfile` plus a
``sources`` map that says, per field, where the number came from and how far to trust
it. Bandwidths are in gigabytes per second (GB/s) unless the name says ``gbit_s``.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sage_infer.core.kv_schema import KVDtype


class Strict(BaseModel):
    """Base for every config section: unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)


class Vendor(str, enum.Enum):
    CPU = "cpu"
    NVIDIA = "nvidia"
    ASCEND = "ascend"
    CAMBRICON = "cambricon"
    HYGON = "hygon"
    KUNLUNXIN = "kunlunxin"


class Confidence(str, enum.Enum):
    """How far to trust a preset number."""

    OFFICIAL = "official"  # vendor datasheet / documentation
    THIRD_PARTY = "third_party"  # reviews, papers, public benchmarks
    MEASURED = "measured"  # measured on a real machine (e.g. by `sage transport probe`)
    PLACEHOLDER = "placeholder"  # a guess to be replaced; do not tune on it


class FieldSource(Strict):
    confidence: Confidence
    ref: str = Field("", description="Where the number comes from: document, URL-free citation, or command.")


TransportBackendName = Literal["shm", "tcp", "torchdist", "rdma"]


class DeviceSection(Strict):
    python_module: str = Field(description="Module that registers the torch device, e.g. torch.cuda, torch_npu.")
    torch_device_type: str = Field(description="torch device type string: cpu, cuda, npu, mlu, xpu.")
    visible_devices_env: str | None = Field(None, description="Env var that masks devices, e.g. CUDA_VISIBLE_DEVICES.")
    distributed_backend: str = Field(description="torch.distributed backend: gloo, nccl, hccl, cncl, bkcl.")
    model_names: list[str] = Field(default_factory=list, description="Device names this preset matches in probes.")
    devices_per_node: int = Field(1, ge=1, le=64)
    dense_bf16_tflops: float | None = Field(None, gt=0, description="Peak dense BF16/FP16 TFLOP/s per device.")


class MemorySection(Strict):
    hbm_gb: float = Field(gt=0, description="Device memory per device in GB (host DDR for cpu).")
    bandwidth_gb_s: float = Field(gt=0, description="Device memory bandwidth per device, GB/s.")
    host_ddr_gb: float | None = Field(None, gt=0, description="Host DDR of one node, GB: the default size of the "
                                      "host KV tier comes from it (tiers.host_bytes: auto).")


class HostLinkSection(Strict):
    kind: Literal["pcie", "memory-bus", "c2c"] = "pcie"
    pcie_gen: int | None = Field(None, ge=1, le=7)
    lanes: int | None = Field(None, ge=1, le=32)
    bandwidth_gb_s: float = Field(gt=0, description="Host<->device bandwidth per direction, GB/s.")


class IntraNodeLinkSection(Strict):
    kind: Literal["none", "nvlink", "hccs", "mlu-link", "xgmi", "xpu-link", "pcie"] = "none"
    topology: Literal["none", "switch", "full-mesh", "ring", "hybrid-cube-mesh", "pcie-switch"] = "none"
    links_per_device: int | None = Field(None, ge=0, le=64)
    per_link_gb_s: float | None = Field(None, gt=0, description="One link, per direction, GB/s.")
    aggregate_gb_s: float | None = Field(None, gt=0, description="All links of one device, bidirectional, GB/s.")

    @model_validator(mode="after")
    def _links_need_numbers(self) -> IntraNodeLinkSection:
        if self.kind != "none" and self.aggregate_gb_s is None:
            raise ValueError(f"intra_node_link.kind is {self.kind!r} but aggregate_gb_s is not set")
        return self


class NicSection(Strict):
    kind: Literal["infiniband", "roce", "ethernet"]
    count: int = Field(ge=1, le=64)
    gbit_s: float = Field(gt=0, description="Line rate of one NIC, Gbit/s.")


class ProbeCommands(Strict):
    info: str | None = None
    topology: str | None = None
    memory: str | None = None


class KVSection(Strict):
    dtypes: list[KVDtype] = Field(min_length=1)
    default_dtype: KVDtype

    @model_validator(mode="after")
    def _default_is_supported(self) -> KVSection:
        if self.default_dtype not in self.dtypes:
            raise ValueError(f"kv.default_dtype {self.default_dtype.value!r} is not in kv.dtypes")
        return self


class TransportSection(Strict):
    backends: list[TransportBackendName] = Field(min_length=1, description="Preferred first.")
    dma_alignment_bytes: int = Field(64, ge=1, le=1 << 20)


class HardwareProfile(Strict):
    """One node type: device, memory, links, NICs, KV dtypes and transport preferences."""

    name: str = Field(min_length=1)
    description: str = ""
    vendor: Vendor
    device: DeviceSection
    memory: MemorySection
    host_link: HostLinkSection
    intra_node_link: IntraNodeLinkSection = IntraNodeLinkSection()
    inter_node_nics: list[NicSection] = Field(default_factory=list)
    probe_commands: ProbeCommands = ProbeCommands()
    kv: KVSection
    transport: TransportSection
    sources: dict[str, FieldSource] = Field(
        default_factory=dict, description="Dotted field path -> where the number came from."
    )

    @model_validator(mode="after")
    def _sources_name_real_fields(self) -> HardwareProfile:
        dumped = self.model_dump(exclude={"sources"})
        for path in self.sources:
            if not has_path(dumped, path):
                raise ValueError(f"sources names {path!r}, which is not a field of a hardware preset")
        return self

    def confidence_of(self, path: str) -> Confidence | None:
        source = self.sources.get(path)
        return source.confidence if source else None


def has_path(tree: object, path: str) -> bool:
    node = tree
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def numeric_leaf_paths(profile: HardwareProfile) -> list[str]:
    """Dotted paths of every number set in `profile` (the fields a source must cover)."""
    out: list[str] = []

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else key)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{prefix}.{i}")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            out.append(prefix)

    walk(profile.model_dump(exclude={"sources"}, mode="json"), "")
    return out
