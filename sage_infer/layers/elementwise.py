"""The elementwise parts of a decoder layer (norms, the residual adds, rotary, silu*mul), as one object a step
executor hands the model: the model has one forward path and calls these, whatever runs them.

- `TorchOps`: PyTorch ops (the reference, what `model.elementwise: torch` runs).
- `FusedOps`: each a C++ pass (`sage_infer.layers.cpu_kernels`): a residual add in the same pass as the norm
  after it, the q/k norms with the rotary, in place over the projections' output (`model.elementwise: fused`).

The forward is written in the fused shape: `add_rms_norm_` adds a sublayer's output to the residual stream in
place and returns the stream normed for the next sublayer, so the reference computes exactly the Hugging Face
``x = x + f(norm(x))`` and the fused ops do the same in one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sage_infer.layers import cpu_kernels as kernels
from sage_infer.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from torch import nn

    from sage_infer.layers.norm import RMSNorm

# `FusedOps.gated_mlp` runs a prefill step's rows through the MLP in passes whose stacked gate/up product (fp32,
# the largest activation of a layer) stays within this many bytes: a buffer above glibc's largest mmap threshold
# (32 MiB) is mapped and page-faulted afresh on every call (sage_infer/hal/malloc.py), which costs a measurable
# share of a long prefill (docs/benchmarks.md "Allocator and fused elementwise ops")
MLP_PASS_BYTES = 16 << 20
MLP_PASS_MIN_ROWS = 128

RotaryTables = tuple[torch.Tensor, torch.Tensor]


class TorchOps:
    """PyTorch elementwise ops: the reference."""

    name = "torch"

    def rotary_tables(self, tables: RotaryTables) -> RotaryTables:
        """This step's rotary tables ([T, 1, D] each, `RotaryEmbedding.cos_sin`) as `rotary` takes them."""
        return tables

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm_(self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``residual += h`` in place; returns ``norm(residual)``."""
        residual.add_(h)
        return norm(residual)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, qk: torch.Tensor | None, tables: RotaryTables,
               q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KvH, D] (`qk`: the two side by side, [T, H + KvH, D], when one projection made
        them) -> rotated q and k, after the per-head q/k norms where the model has them."""
        heads = q.shape[1]
        if qk is not None and q_norm is None:  # one rotary for both
            return apply_rotary(qk, *tables).split([heads, k.shape[1]], dim=1)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(q, *tables), apply_rotary(k, *tables)

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate) * up)`` with gate and up one stacked projection."""
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(F.silu(gate) * up)


class FusedOps(TorchOps):
    """Each elementwise op a C++ pass, in place where it can be (CPU)."""

    name = "fused"

    def rotary_tables(self, tables: RotaryTables) -> RotaryTables:
        return tuple(table[:, 0] for table in tables)  # [T, D], the shape the C++ rotary takes

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return kernels.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm_(self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return kernels.add_rms_norm_(h, residual, norm.weight, norm.eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, qk: torch.Tensor | None, tables: RotaryTables,
               q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """In place over the projections' output (`kernels.rope_`), the q/k norms in the same pass."""
        cos, sin = tables
        if q_norm is not None:
            kernels.rope_(q, cos, sin, q_norm.weight, q_norm.eps)
            kernels.rope_(k, cos, sin, k_norm.weight, k_norm.eps)
        elif qk is not None:  # q and k side by side: one pass
            kernels.rope_(qk, cos, sin)
        else:
            kernels.rope_(q, cos, sin)
            kernels.rope_(k, cos, sin)
        return q, k

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up as one C++ pass (`kernels.silu_mul`); rows in passes of `pass_rows` (each row's result
        is its own: a pass only bounds the intermediate buffers)."""
        rows = pass_rows(down.in_features)
        if x.shape[0] <= rows:
            return down(kernels.silu_mul(gate_up(x)))
        out = x.new_empty(x.shape[0], down.out_features)
        for start in range(0, x.shape[0], rows):
            out[start:start + rows] = down(kernels.silu_mul(gate_up(x[start:start + rows])))
        return out


def pass_rows(intermediate_size: int) -> int:
    """Rows per pass of `FusedOps.gated_mlp`: the stacked gate/up product of that many rows fits `MLP_PASS_BYTES`
    in fp32 (at least `MLP_PASS_MIN_ROWS`)."""
    return max(MLP_PASS_MIN_ROWS, MLP_PASS_BYTES // (4 * intermediate_size * 2))


TORCH_OPS = TorchOps()
FUSED_OPS = FusedOps()
