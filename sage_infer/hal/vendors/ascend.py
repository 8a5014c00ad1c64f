"""Huawei Ascend NPUs through torch_npu (device type ``npu``) and npu-smi."""

from __future__ import annotations

from sage_infer.core.kv_schema import KVDtype
from sage_infer.hal.vendors.common import VendorReport, probe_torch_plugin

# no fp8 on 910B; int8 KV is supported by the CANN attention kernels
KV_DTYPES = (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.INT8)


def probe() -> VendorReport:
    return probe_torch_plugin("ascend", "torch_npu", "npu", ["npu-smi", "info", "-t", "topo"], KV_DTYPES)
