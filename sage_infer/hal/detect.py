"""Find what this machine has: the host CPU and every vendor's accelerators.

Vendor probes are imported lazily by name; a probe that raises is reported as
unavailable with the error as its reason, so detection never fails as a whole.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from sage_infer.hal.cpu import CpuInfo, probe_cpu
from sage_infer.hal.vendors.common import VendorReport
from sage_infer.interfaces.capability import AcceleratorDescriptor

# Hygon before NVIDIA: a ROCm torch also answers torch.cuda, and the NVIDIA probe
# checks torch.version.cuda so it does not claim a DCU.
VENDOR_PROBES: dict[str, str] = {
    "nvidia": "sage_infer.hal.vendors.nvidia",
    "hygon": "sage_infer.hal.vendors.hygon",
    "ascend": "sage_infer.hal.vendors.ascend",
    "cambricon": "sage_infer.hal.vendors.cambricon",
    "kunlunxin": "sage_infer.hal.vendors.kunlunxin",
}


@dataclass(slots=True)
class HardwareReport:
    cpu: CpuInfo
    vendors: list[VendorReport] = field(default_factory=list)

    @property
    def accelerators(self) -> list[AcceleratorDescriptor]:
        return [d for v in self.vendors if v.available for d in v.devices]

    @property
    def primary_vendor(self) -> str:
        """The vendor of the first available accelerator, or ``cpu``."""
        for report in self.vendors:
            if report.available and report.devices:
                return report.vendor
        return "cpu"

    def to_dict(self) -> dict:
        return {"cpu": self.cpu.to_dict(), "vendors": [v.to_dict() for v in self.vendors]}


def probe_vendor(vendor: str) -> VendorReport:
    try:
        module = importlib.import_module(VENDOR_PROBES[vendor])
        return module.probe()
    except Exception as err:  # noqa: BLE001 - any vendor failure becomes a reason
        return VendorReport(vendor, False, f"probe failed: {type(err).__name__}: {err}")


def detect_devices(measure: bool = True) -> HardwareReport:
    """Probe the CPU (with a memcpy measurement when `measure`) and every vendor."""
    return HardwareReport(cpu=probe_cpu(measure=measure), vendors=[probe_vendor(v) for v in VENDOR_PROBES])
