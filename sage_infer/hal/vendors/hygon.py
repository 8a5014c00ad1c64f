"""Hygon DCU through ROCm/HIP PyTorch (device type ``cuda``) and hy-smi / rocm-smi."""

from __future__ import annotations

from sage_infer.core.kv_schema import KVDtype
from sage_infer.hal.vendors.common import VendorReport, parse_topology_or_none, run_tool, tool_present
from sage_infer.interfaces.capability import AcceleratorDescriptor

_DTYPES = (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.INT8, KVDtype.INT4)


def probe() -> VendorReport:
    tools = {"hy-smi": tool_present("hy-smi"), "rocm-smi": tool_present("rocm-smi")}
    import torch

    devices: list[AcceleratorDescriptor] = []
    if torch.version.hip and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(AcceleratorDescriptor("hygon", "cuda", i, props.name, props.total_memory, _DTYPES))
    smi = "hy-smi" if tools["hy-smi"] else "rocm-smi" if tools["rocm-smi"] else None
    text = run_tool([smi, "--showtopo", "--json"]) if smi else None
    topology, topo_problem = parse_topology_or_none("hygon", text)
    if not devices:
        why = "torch is not a ROCm/HIP build" if not torch.version.hip else "torch.cuda.is_available() is False"
        tool = f"{smi} found" if smi else "hy-smi/rocm-smi not found"
        return VendorReport("hygon", False, f"no Hygon DCU: {why}; {tool}", topology=topology, tools=tools)
    return VendorReport("hygon", True, topo_problem, devices=devices, topology=topology, tools=tools,
                        torch_module=f"torch {torch.__version__} (HIP {torch.version.hip})")
