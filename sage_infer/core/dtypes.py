"""The float element types, under each name they go by: sage's (the unquantized `KVDtype` values, the config's
`model.dtype`), torch's, and Hugging Face `config.json`'s (`torch_dtype`, also vLLM's `dtype`). The one home of
these names: everything that maps one to another reads it from here."""

from __future__ import annotations

import torch

from sage_infer.core.kv_schema import KVDtype

FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in FLOAT_DTYPES.items()}
HF_DTYPE_NAMES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # config.json's -> sage's
# the torch element type that stores each unquantized KV dtype
TORCH_DTYPES: dict[KVDtype, torch.dtype] = {KVDtype(name): dtype for name, dtype in FLOAT_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """sage's name of a float dtype (fp32, bf16, fp16), else torch's own."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype_name(name: object, default: torch.dtype | None = None) -> torch.dtype | None:
    """The torch dtype a name means, in sage's spelling or config.json's (``bfloat16``, ``torch.bfloat16``);
    `default` for anything else."""
    text = str(name).removeprefix("torch.")
    return FLOAT_DTYPES.get(HF_DTYPE_NAMES.get(text, text), default)
