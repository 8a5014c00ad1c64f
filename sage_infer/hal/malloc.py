"""The host allocator's thresholds: keep freed activation buffers in the heap for the next step.

Every engine step allocates and frees the same activation tensors (1-32 MiB each at a few
thousand prefill rows). glibc serves blocks that large with a fresh ``mmap`` and gives them
back on ``free`` (and trims the heap's top above 2× the mmap threshold), so the next step's
first write to each page faults and the kernel zero-fills it, a large share of a long prefill
step (docs/benchmarks.md "Allocator and fused elementwise ops"). vLLM's CPU worker avoids
it by preloading tcmalloc; sage stays in-process and raises glibc's two thresholds instead
(``mallopt``), which it may do at any time. Blocks above glibc's cap (32 MiB on 64-bit) are
still mapped per call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: the largest value it accepts
TRIM_THRESHOLD = 1 << 30  # give the heap's top back to the kernel only above 1 GiB free


def keep_freed_buffers(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = TRIM_THRESHOLD) -> str | None:
    """Raise glibc's mmap and trim thresholds for this process. None when applied, else why not
    (not Linux with glibc, or glibc refused a value)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc on Linux ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError) as err:
        return f"cannot reach mallopt: {err}"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the trim threshold first: setting the mmap threshold alone leaves glibc's dynamic trim at 2× it
    for name, param, value in (("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, trim_threshold),
                               ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, mmap_threshold)):
        if mallopt(param, value) != 1:
            return f"mallopt({name}, {value}) was refused"
    return None
