"""Cambricon MLUs through torch_mlu and cnmon."""

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
    tools = {"cnmon": tool_present("cnmon")}
    topology, topo_problem = parse_topology_or_none("cambricon", run_tool(["cnmon", "topo", "-m"]))
    if not module_present("torch_mlu"):
        tool = "cnmon found" if tools["cnmon"] else "cnmon not found"
        return VendorReport("cambricon", False, f"torch_mlu is not installed; {tool}", topology=topology, tools=tools)
    try:
        import torch
        import torch_mlu  # noqa: F401  registers torch.mlu

        devices = [
            AcceleratorDescriptor("cambricon", "mlu", i, torch.mlu.get_device_name(i),
                                  torch.mlu.get_device_properties(i).total_memory, _DTYPES)
            for i in range(torch.mlu.device_count())
        ]
        version = getattr(torch_mlu, "__version__", "?")
    except Exception as err:  # a broken Neuware install must not break the probe
        return VendorReport("cambricon", False, f"torch_mlu failed to load: {err}", topology=topology, tools=tools)
    if not devices:
        return VendorReport("cambricon", False, "torch_mlu sees no MLU", topology=topology, tools=tools)
    return VendorReport("cambricon", True, topo_problem, devices=devices, topology=topology, tools=tools,
                        torch_module=f"torch_mlu {version}")
