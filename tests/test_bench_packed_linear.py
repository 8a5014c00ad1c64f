"""bench/packed_linear.py --cold-layers: the rows kernel over distinct weights, a row of output per row count
(no timing is asserted: only that every count ran and what each figure is relative to)."""

from __future__ import annotations

import pytest

from bench.packed_linear import COLD_ROWS, cold
from sage_infer.layers.cpu_kernels import kernel_unavailable


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"the C++ kernels are unavailable: {kernel_unavailable()}")
def test_cold_passes_time_every_row_count_over_all_layers_against_one_row():
    rows = cold(layers=3, repeats=1, shapes=[(256, 512), (512, 256)])
    assert [row["rows"] for row in rows] == COLD_ROWS
    assert rows[0]["vs_one_row"] == 1.0
    for row in rows:
        assert row["ms"] > 0 and row["gb_s"] > 0
        # the ratio is the pass's time over the one-row pass's
        assert row["vs_one_row"] == pytest.approx(row["ms"] / rows[0]["ms"], rel=0.05, abs=0.02)
