"""Cambricon MLUs through torch_mlu (device type ``mlu``) and cnmon."""

from __future__ import annotations

from sage_infer.core.kv_schema import KVDtype
from sage_infer.hal.vendors.common import VendorReport, probe_torch_plugin

KV_DTYPES = (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.INT8)


def probe() -> VendorReport:
    return probe_torch_plugin("cambricon", "torch_mlu", "mlu", ["cnmon", "topo", "-m"], KV_DTYPES)
