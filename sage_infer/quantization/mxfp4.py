"""MXFP4 expert weights (``quantization_config.quant_method: mxfp4``, how OpenAI ships gpt-oss), dequantized.

A checkpoint stores each expert weight ``W`` [E, out, in] as ``<name>_blocks`` [E, out, in / 32, 16] uint8 (two FP4
E2M1 codes a byte, the low nibble first) and ``<name>_scales`` [E, out, in / 32] uint8 (one power-of-two exponent per
32 values, biased by 127). `dequantize` turns them into the float weight in transformers' layout for gpt-oss
([E, in, out]: ``transformers.integrations.mxfp4.convert_moe_packed_tensors``); every value is an FP4 value times a
power of two, so fp32 and bf16 hold it exactly. On a CPU with the kernels the experts may instead stay MXFP4
(`sage_infer.layers.moe_swiglu.ClampedSwigluExperts.keep_mxfp4`), one expert dequantized where a step needs its
float weight.
"""

from __future__ import annotations

import torch

QUANT_METHOD = "mxfp4"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
KNOWN_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")
SUFFIXES = ("_blocks", "_scales")


def check_config(qc: dict, architecture: str | None, built_for: tuple[str, ...]) -> None:
    """ValueError naming the ``quantization_config`` field of an MXFP4 config sage does not run: an architecture
    whose experts it does not build MXFP4 for, or a field it does not know."""
    if architecture not in built_for:
        raise ValueError(f"quantization_config.quant_method: {QUANT_METHOD!r} is built for {', '.join(built_for)} "
                         f"experts only (the model is {architecture})")
    unknown = sorted(set(qc) - set(KNOWN_FIELDS))
    if unknown:
        raise ValueError(f"quantization_config.{unknown[0]}: not supported with {QUANT_METHOD!r} (sage knows "
                         f"{', '.join(KNOWN_FIELDS)})")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows_of=None) -> torch.Tensor:
    """blocks [E, out, G, 16] uint8, scales [E, out, G] uint8 -> the weight [E, G * 32, out] in `dtype`, each
    expert's rows made by `rows_of` (default `expert_rows`; the CPU kernel's, where the model passes it)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    rows_of = rows_of or expert_rows
    return torch.stack([rows_of(b, s, dtype).t() for b, s in zip(blocks, scales)])


def expert_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's blocks [out, G, 16] uint8 and scales [out, G] uint8 -> its weight's rows [out, G * 32] in
    `dtype`: each code's FP4 value times 2^(exponent - 127), exact (what torch.ldexp gives), by two table lookups
    (`sage_infer.layers.moe_swiglu.mxfp4_rows` does it on the CPU kernel, the same bits)."""
    out_rows, groups = scales.shape
    values = _byte_values(blocks.device)[blocks.int()]  # [out, G, 16, 2]: each byte's low nibble, then its high one
    values = values.view(out_rows, groups, 32) * _exponent_values(blocks.device)[scales.int()].unsqueeze(-1)
    return values.reshape(out_rows, -1).to(dtype)


def _byte_values(device: torch.device) -> torch.Tensor:
    codes = torch.arange(256, device=device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=1)


def _exponent_values(device: torch.device) -> torch.Tensor:
    return torch.ldexp(torch.ones(256, device=device), torch.arange(256, dtype=torch.int32, device=device) - 127)


class PairedTensors:
    """Collects each ``<name>_blocks`` / ``<name>_scales`` pair as a checkpoint's files yield them (in any order,
    any file); `add` gives the dequantized ``<name>`` once both are in."""

    def __init__(self, dtype: torch.dtype, rows_of=None) -> None:
        self.dtype, self.rows_of = dtype, rows_of
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """`name` a blocks or scales tensor -> (the weight's name, the weight) when its pair is complete, else
        None (kept)."""
        suffix = next(s for s in SUFFIXES if name.endswith(s))
        weight = name.removesuffix(suffix)
        pair = self.waiting.setdefault(weight, {})
        pair[suffix] = tensor
        if len(pair) < 2:
            return None
        del self.waiting[weight]
        return weight, dequantize(pair["_blocks"], pair["_scales"], self.dtype, self.rows_of)
