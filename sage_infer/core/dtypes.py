"""The torch element type that stores each unquantized KV dtype."""

from __future__ import annotations

import torch

from sage_infer.core.kv_schema import KVDtype

TORCH_DTYPES: dict[KVDtype, torch.dtype] = {
    KVDtype.FP32: torch.float32,
    KVDtype.FP16: torch.float16,
    KVDtype.BF16: torch.bfloat16,
}
