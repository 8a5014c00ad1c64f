"""What every vendor probe returns, and how it runs the vendor's CLI tool."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from dataclasses import dataclass, field

from sage_infer.hal.topology.model import Topology, TopologyParseError
from sage_infer.interfaces.capability import AcceleratorDescriptor

TOOL_TIMEOUT_S = 15.0


@dataclass(slots=True)
class VendorReport:
    """One vendor's answer: devices found, or why there are none."""

    vendor: str
    available: bool
    reason: str | None = None  # why not available (or what was only partly found)
    devices: list[AcceleratorDescriptor] = field(default_factory=list)
    topology: Topology | None = None
    tools: dict[str, bool] = field(default_factory=dict)  # CLI tool -> found on PATH
    torch_module: str | None = None  # e.g. "torch_npu 2.1.0" when importable

    def to_dict(self) -> dict:
        return {
            "vendor": self.vendor,
            "available": self.available,
            "reason": self.reason,
            "devices": [_device_dict(d) for d in self.devices],
            "topology": self.topology.to_dict() if self.topology else None,
            "tools": self.tools,
            "torch_module": self.torch_module,
        }


def _device_dict(d: AcceleratorDescriptor) -> dict:
    return {
        "index": d.index,
        "name": d.name,
        "torch_device": d.torch_device,
        "memory_bytes": d.memory_bytes,
        "kv_dtypes": [t.value for t in d.kv_dtypes],
        "numa_node": d.numa_node,
        "driver_version": d.driver_version,
    }


def run_tool(args: list[str], timeout: float = TOOL_TIMEOUT_S) -> str | None:
    """stdout of a vendor tool, or None when it is absent, fails or times out."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def tool_present(name: str) -> bool:
    return shutil.which(name) is not None


def module_present(name: str) -> bool:
    """True when `name` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def parse_topology_or_none(vendor: str, text: str | None) -> tuple[Topology | None, str | None]:
    """(topology, None) or (None, why not) — a bad tool output never breaks a probe."""
    if text is None:
        return None, None
    from sage_infer.hal.topology import parse_topology

    try:
        return parse_topology(vendor, text), None
    except TopologyParseError as err:
        return None, f"topology output not understood: {err}"


def probe_torch_plugin(
    vendor: str,
    plugin: str,
    device_type: str,
    tool_argv: list[str],
    kv_dtypes: tuple,
) -> VendorReport:
    """Probe a vendor whose devices come from an out-of-tree torch plugin (torch_npu,
    torch_mlu): the tool's topology first, then the plugin, imported only here."""
    import importlib

    tool = tool_argv[0]
    tools = {tool: tool_present(tool)}
    topology, topo_problem = parse_topology_or_none(vendor, run_tool(tool_argv))
    tool_note = f"{tool} found" if tools[tool] else f"{tool} not found"
    if not module_present(plugin):
        return VendorReport(vendor, False, f"{plugin} is not installed; {tool_note}", topology=topology, tools=tools)
    try:
        import torch

        module = importlib.import_module(plugin)  # registers torch.<device_type>
        api = getattr(torch, device_type)
        devices = [
            AcceleratorDescriptor(vendor, device_type, i, api.get_device_name(i),
                                  api.get_device_properties(i).total_memory, kv_dtypes)
            for i in range(api.device_count())
        ]
        version = getattr(module, "__version__", "?")
    except Exception as err:  # noqa: BLE001 - a broken driver stack must not break the probe
        return VendorReport(vendor, False, f"{plugin} failed to load: {err}", topology=topology, tools=tools)
    if not devices:
        return VendorReport(vendor, False, f"{plugin} sees no {device_type.upper()}", topology=topology, tools=tools)
    return VendorReport(vendor, True, topo_problem, devices=devices, topology=topology, tools=tools,
                        torch_module=f"{plugin} {version}")
