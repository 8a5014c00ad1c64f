"""Kunlunxin XPUs, found by PCI vendor id 0x1d22 and xpu-smi.

Not Intel's ``torch.xpu``: Kunlunxin devices are recognised by their PCI vendor id
and their own tool, never by ``torch.xpu.is_available()``. Kunlunxin's own torch build
(torch_xmlir, see presets/hardware/kunlunxin-p800.yaml) exposes the devices as ``cuda``.
"""

from __future__ import annotations

from pathlib import Path

from sage_infer.core.kv_schema import KVDtype
from sage_infer.hal.vendors.common import VendorReport, parse_topology_or_none, run_tool, tool_present
from sage_infer.interfaces.capability import AcceleratorDescriptor

PCI_VENDOR_ID = "0x1d22"
PCI_DEVICES = Path("/sys/bus/pci/devices")
_DTYPES = (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.INT8)


def scan_pci(root: Path = PCI_DEVICES) -> list[str]:
    """PCI addresses whose vendor file reads 0x1d22, sorted."""
    found = []
    for device in sorted(root.glob("*")):
        try:
            if (device / "vendor").read_text().strip().lower() == PCI_VENDOR_ID:
                found.append(device.name)
        except OSError:
            continue
    return found


def probe(pci_root: Path = PCI_DEVICES) -> VendorReport:
    tools = {"xpu-smi": tool_present("xpu-smi")}
    addresses = scan_pci(pci_root)
    topology, topo_problem = parse_topology_or_none("kunlunxin", run_tool(["xpu-smi", "topo", "-m"]))
    if not addresses:
        tool = "xpu-smi found" if tools["xpu-smi"] else "xpu-smi not found"
        return VendorReport("kunlunxin", False, f"no PCI device with vendor id {PCI_VENDOR_ID}; {tool}",
                            topology=topology, tools=tools)
    devices = [
        AcceleratorDescriptor("kunlunxin", "cuda", i, f"Kunlunxin XPU ({addr})", 0, _DTYPES)
        for i, addr in enumerate(addresses)
    ]
    reason = topo_problem or "memory size unknown without the vendor torch plugin"
    return VendorReport("kunlunxin", True, reason, devices=devices, topology=topology, tools=tools)
