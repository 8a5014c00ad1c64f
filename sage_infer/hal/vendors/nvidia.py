"""NVIDIA GPUs through torch.cuda (CUDA build) and nvidia-smi."""

from __future__ import annotations

from sage_infer.core.kv_schema import KVDtype
from sage_infer.hal.vendors.common import VendorReport, parse_topology_or_none, run_tool, tool_present
from sage_infer.interfaces.capability import AcceleratorDescriptor

QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"]
_BASE_DTYPES = (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.INT8, KVDtype.INT4)
_FP8 = (KVDtype.FP8_E4M3, KVDtype.FP8_E5M2)


def kv_dtypes_for_capability(major: int, minor: int) -> tuple[KVDtype, ...]:
    """fp8 KV needs Ada (8.9) or Hopper (9.0) and later; bf16 needs Ampere (8.0)."""
    dtypes = _BASE_DTYPES if major >= 8 else tuple(d for d in _BASE_DTYPES if d is not KVDtype.BF16)
    return dtypes + _FP8 if (major, minor) >= (8, 9) else dtypes


def parse_query_gpu(text: str) -> list[AcceleratorDescriptor]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,driver_version`` CSV (MiB)."""
    devices = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        memory_mib = int(float(fields[2])) if fields[2].replace(".", "", 1).isdigit() else 0
        devices.append(
            AcceleratorDescriptor(
                vendor="nvidia",
                device_type="cuda",
                index=int(fields[0]),
                name=fields[1],
                memory_bytes=memory_mib * 1024 * 1024,
                kv_dtypes=_BASE_DTYPES,
                driver_version=fields[3],
            )
        )
    return devices


def probe() -> VendorReport:
    tools = {"nvidia-smi": tool_present("nvidia-smi")}
    devices: list[AcceleratorDescriptor] = []
    import torch

    if torch.version.cuda and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                AcceleratorDescriptor(
                    vendor="nvidia",
                    device_type="cuda",
                    index=i,
                    name=props.name,
                    memory_bytes=props.total_memory,
                    kv_dtypes=kv_dtypes_for_capability(props.major, props.minor),
                )
            )
    elif tools["nvidia-smi"]:
        devices = parse_query_gpu(run_tool(QUERY) or "")
    topology, topo_problem = parse_topology_or_none("nvidia", run_tool(["nvidia-smi", "topo", "-m"]))
    if not devices:
        why = "torch has no CUDA build" if not torch.version.cuda else "torch.cuda.is_available() is False"
        smi = "nvidia-smi lists no GPU" if tools["nvidia-smi"] else "nvidia-smi not found"
        return VendorReport("nvidia", False, f"no NVIDIA GPU: {why}; {smi}", tools=tools)
    return VendorReport("nvidia", True, topo_problem, devices=devices, topology=topology, tools=tools,
                        torch_module=f"torch {torch.__version__} (CUDA {torch.version.cuda})")
