"""How many binaries a `triton.jit` kernel holds: the GPU tests check that integers varying between steps do not
make Triton compile a kernel again (it specializes on an integer that is 1 or a multiple of 16)."""

from __future__ import annotations

import pytest


def compiled_variants(kernel) -> int:
    """Binaries `kernel` (a `triton.jit` function) holds over the devices it ran on."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        import triton

        pytest.skip(f"triton {triton.__version__} keeps no device_caches on its jit functions")
    return sum(len(entry[0]) for entry in caches.values())
