"""Huawei Ascend NPUs through torch_npu and npu-smi."""

from __future__ import annotations

from sage_infer.hal.vendors.common import (
    VendorReport,
    module_present,
    parse_topology_or_none,
    run_tool,
    tool_present,
)
from sage_infer.interfaces.capability import AcceleratorDescriptor
from sage_infer.interfaces.kv_cache import KVDtype

_DTYPES = (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.INT8)


def probe() -> VendorReport:
    tools = {"npu-smi": tool_present("npu-smi")}
    topology, topo_problem = parse_topology_or_none("ascend", run_tool(["npu-smi", "info", "-t", "topo"]))
    if not module_present("torch_npu"):
        tool = "npu-smi found" if tools["npu-smi"] else "npu-smi not found"
        return VendorReport("ascend", False, f"torch_npu is not installed; {tool}", topology=topology, tools=tools)
    try:
        import torch
        import torch_npu  # noqa: F401  registers torch.npu

        count = torch.npu.device_count()
        devices = [
            AcceleratorDescriptor("ascend", "npu", i, torch.npu.get_device_name(i),
                                  torch.npu.get_device_properties(i).total_memory, _DTYPES)
            for i in range(count)
        ]
        version = getattr(torch_npu, "__version__", "?")
    except Exception as err:  # a broken CANN install must not break the probe
        return VendorReport("ascend", False, f"torch_npu failed to load: {err}", topology=topology, tools=tools)
    if not devices:
        return VendorReport("ascend", False, "torch_npu sees no NPU", topology=topology, tools=tools)
    return VendorReport("ascend", True, topo_problem, devices=devices, topology=topology, tools=tools,
                        torch_module=f"torch_npu {version}")
