"""Batch-invariant products (`model.deterministic`): a row's result never depends on the rows beside it.

A GEMM library picks its kernel, its blocking and the split of the reduction across threads from
the shape of the product, so the same row of activations can come out a few ulps apart when it is
multiplied alone (a request served on its own) or among 100 others (the same request under load):
greedy decoding then flips near-tie tokens. `RowTiledLinear` runs every product on exactly
`rows` rows — the batch cut into tiles of that many, the last one padded with zeros — so every row,
whatever the batch, goes through the same kernel on the same shape, and each output element sums
its products in one fixed order.

The rest of a deterministic step is per row already or made so by the engine: norms, rotary and
activations work row by row; every query row, prefill chunks' included, attends through the paged
decode kernel, which reduces one row's context in block order whatever else is in the batch; and
cascade attention (a different reduction for rows that share a prefix) and the C++ decode step (other
kernels than a mixed step's) are off (`engine/build.py`).
"""

from __future__ import annotations

import torch
from torch import nn

DETERMINISTIC_ROWS = 16  # rows of every product in deterministic mode: one decode row costs what 16 do when the
# weights' read dominates (small batches on CPU); a long prefill reads the weights once per 16 rows


class RowTiledLinear(nn.Module):
    """`inner` (any linear module: nn.Linear, PackedLinear, a quantized linear) applied to tiles of exactly `rows`
    rows, each copied into one buffer first so every product also sees the same memory alignment."""

    def __init__(self, inner: nn.Module, rows: int = DETERMINISTIC_ROWS) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows
        self.in_features = inner.in_features
        self.out_features = inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        n, rows = flat.shape[0], self.rows
        tile = flat.new_zeros((rows, self.in_features))
        out = None
        for start in range(0, n, rows):
            count = min(rows, n - start)
            tile[:count].copy_(flat[start : start + count])
            if count < rows:
                tile[count:].zero_()
            part = self.inner(tile)
            if out is None:
                out = part.new_empty((n, self.out_features))
            out[start : start + count] = part[:count]
        if out is None:  # no rows at all
            out = self.inner(tile)[:0]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"rows={self.rows}"


def tile_linears(model: nn.Module, rows: int = DETERMINISTIC_ROWS) -> int:
    """Wrap every linear layer of `model` (anything with `in_features` and `out_features` that is not a wrapper
    already) in `RowTiledLinear`; how many. Run after packing and fusing: it wraps what the model will call."""
    count = 0
    for parent in list(model.modules()):
        if isinstance(parent, RowTiledLinear):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, RowTiledLinear) or not (hasattr(child, "in_features") and
                                                          hasattr(child, "out_features")):
                continue
            setattr(parent, name, RowTiledLinear(child, rows))
            count += 1
    return count
