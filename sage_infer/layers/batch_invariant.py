"""Batch-invariant products (`model.deterministic`): a row's result never depends on the rows beside it.

A GEMM library picks its kernel, its blocking and the split of the reduction across threads from
the shape of the product, so the same row of activations can come out a few ulps apart when it is
multiplied alone (a request served on its own) or among 100 others (the same request under load):
greedy decoding then flips near-tie tokens. `RowTiledLinear` runs every product on exactly
`rows` rows — the batch cut into tiles of that many, the last one padded with zeros — so every row,
whatever the batch, goes through the same kernel on the same shape, and each output element sums
its products in one fixed order. A layer whose few-row kernel already computes every row alone, the same
way whatever the row count (`row_invariant_rows`: PackedLinear's bf16 rows kernel, up to 12 rows, on a CPU
without bf16 packing), needs no padding: its batch is cut into chunks of up to that many rows, passed as
they are.

The rest of a deterministic step is per row already or made so by the engine: norms, rotary and
activations work row by row; every query row, prefill chunks' included, attends through the paged
decode kernel, which reduces one row's context in block order whatever else is in the batch; and
cascade attention (a different reduction for rows that share a prefix) and the C++ decode step (other
kernels than a mixed step's) are off (`engine/build.py`).
"""

from __future__ import annotations

import torch
from torch import nn

DETERMINISTIC_ROWS = 16  # rows of every padded product in deterministic mode: one decode row costs what 16 do
# when the weights' read dominates (small batches on CPU); a long prefill reads the weights once per 16 rows


class RowTiledLinear(nn.Module):
    """`inner` (any linear module: nn.Linear, PackedLinear, a quantized linear) applied to tiles of exactly `rows`
    rows, each copied into one buffer first so every product also sees the same memory alignment. With
    `pad=False` (an `inner` whose products of up to `rows` rows compute each row alone, whatever their count)
    to chunks of up to `rows` rows as they are.

    The buffer (`_tile`: [rows, in_features]) is kept between calls, its rows past the last tile's zeroed only
    when an earlier tile filled them: a decode step's one-row product costs a row copy, not an allocation, a
    fill and a copy back. Under autograd every call gets its own buffer (an in-place copy into a shared one
    would rewrite what an earlier call's graph saved)."""

    def __init__(self, inner: nn.Module, rows: int = DETERMINISTIC_ROWS, pad: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows
        self.pad = pad
        self.in_features = inner.in_features
        self.out_features = inner.out_features
        self._tile: torch.Tensor | None = None  # not a buffer: no state, and not moved by .to()
        self._filled = 0  # rows of `_tile` that may hold an earlier tile's values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        n, rows = flat.shape[0], self.rows
        if not self.pad and n > 0:  # (no rows at all: the padded path, a product needs one)
            out = self.inner(flat) if n <= rows else torch.cat([self.inner(chunk) for chunk in flat.split(rows)])
            return out.view(*x.shape[:-1], self.out_features)
        tile = self._buffer(flat)
        if n <= rows:  # one tile (every decode step up to `rows` rows): its product's first rows are the answer
            self._fill(tile, flat[:n])
            return self.inner(tile)[:n].view(*x.shape[:-1], self.out_features)
        out = None
        for start in range(0, n, rows):
            count = min(rows, n - start)
            self._fill(tile, flat[start : start + count])
            part = self.inner(tile)
            if out is None:
                out = part.new_empty((n, self.out_features))
            out[start : start + count] = part[:count]
        return out.view(*x.shape[:-1], self.out_features)

    def _buffer(self, flat: torch.Tensor) -> torch.Tensor:
        """The zero-padded tile `flat`'s rows are copied into: the kept one, or a new one (first call, another
        dtype or device, autograd on, inference mode switched)."""
        if torch.is_grad_enabled():
            return flat.new_zeros((self.rows, self.in_features))  # this call's alone: `_filled` is the kept one's
        tile = self._tile
        if (tile is None or tile.dtype != flat.dtype or tile.device != flat.device
                or tile.is_inference() != torch.is_inference_mode_enabled()):
            tile = self._tile = flat.new_zeros((self.rows, self.in_features))
            self._filled = 0
        return tile

    def _fill(self, tile: torch.Tensor, rows: torch.Tensor) -> None:
        """`rows` into the tile's first rows; the rows after them zero."""
        count = rows.shape[0]
        tile[:count].copy_(rows)
        if tile is self._tile:
            if self._filled > count:
                tile[count : self._filled].zero_()
            self._filled = count
        else:  # a fresh tile: zero but for what earlier tiles of this call filled
            tile[count:].zero_()

    def extra_repr(self) -> str:
        return f"rows={self.rows}" + ("" if self.pad else ", pad=False")


def tile_linears(model: nn.Module, rows: int = DETERMINISTIC_ROWS) -> int:
    """Wrap every linear layer of `model` (anything with `in_features` and `out_features` that is not a wrapper
    already) in `RowTiledLinear`: padded tiles of `rows` rows, or unpadded chunks of its own `row_invariant_rows`
    where it has them; how many. Run after packing and fusing: it wraps what the model will call."""
    count = 0
    for parent in list(model.modules()):
        if isinstance(parent, RowTiledLinear):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, RowTiledLinear) or not (hasattr(child, "in_features") and
                                                          hasattr(child, "out_features")):
                continue
            own = getattr(child, "row_invariant_rows", 0)
            setattr(parent, name, RowTiledLinear(child, own or rows, pad=not own))
            count += 1
    return count


def describe_tiling(model: nn.Module) -> str:
    """How `tile_linears` wrapped `model`'s linear layers, for the start-up line."""
    tiled = [m for m in model.modules() if isinstance(m, RowTiledLinear)]
    parts = []
    for pad, what in ((True, "fixed {}-row products"), (False, "a kernel that computes each row alone (chunks of "
                                                                 "up to {} rows)")):
        group = [m for m in tiled if m.pad == pad]
        if group:
            parts.append(f"{len(group)} on " + what.format("/".join(str(r) for r in sorted({m.rows for m in group}))))
    return f"linear layers: {', '.join(parts) or 'none'}"
