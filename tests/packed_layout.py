"""Whether sage's CPU kernels read oneDNN's packed bf16 weights in place on this CPU: oneDNN picks the blocking per CPU
(blocks of 64 rows, or 32 for AMX tiles), and `small_linear` and the grouped-experts kernel read those two. Tests
of those paths skip with this reason where they cannot run."""

from __future__ import annotations

import functools

import torch

from sage_infer.layers.cpu_kernels import kernel_unavailable, packed_layout_matches
from sage_infer.layers.linear import PACK_BATCH_HINT, packing_unavailable


@functools.cache
def packed_block_rows() -> int:
    """The rows per block of oneDNN's packed bf16 weights here (64; 32 where it packs for AMX tiles); 0 where the
    kernels cannot read them or cannot run."""
    if kernel_unavailable() is not None or packing_unavailable(torch.bfloat16) is not None:
        return 0
    weight = torch.randn(128, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    return packed_layout_matches(torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed), weight)


def packed_bf16_layout() -> str | None:
    """Why the kernels cannot read oneDNN's packed bf16 weights here (None: they can)."""
    if kernel_unavailable() is not None:
        return f"CPU kernels: {kernel_unavailable()}"
    if packing_unavailable(torch.bfloat16) is not None:
        return f"oneDNN cannot pack bf16 here: {packing_unavailable(torch.bfloat16)}"
    if packed_block_rows():
        return None
    amx = " (this CPU has AMX)" if "amx_bf16" in open("/proc/cpuinfo").read() else ""
    return f"oneDNN packs bf16 weights in another layout than the kernels' on this CPU{amx}"


def pack_blocks(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """bf16 [N, K] -> small_linear's layout with blocks of `rows` rows ([N/rows][K/32*16][rows][2], zero padded), as
    oneDNN packs it (64: AVX512-BF16; 32: AMX tiles), built here so that either layout is tested on any CPU."""
    n, k = weight.shape
    pairs = (k + 31) // 32 * 16
    padded = torch.zeros((n + rows - 1) // rows * rows, pairs * 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(-1, rows, pairs, 2).permute(0, 2, 1, 3).contiguous()
