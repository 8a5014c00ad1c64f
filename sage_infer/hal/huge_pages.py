"""2 MiB transparent huge pages for long-lived host buffers: the packed weights and the KV pool of a CPU
model.

A batch-1 decode step streams every weight once; with 4 KiB pages that is one TLB miss per page and
a hardware prefetcher that stops at every page boundary. Backing the packed weights with huge pages
raises the weight-read bandwidth of the decode GEMVs (the two copies timed alternately in one process:
`bench/small_linear.py --huge-pages`, docs/benchmarks.md "Huge pages"). The weights are already written
when sage sees them (oneDNN packs
them into its own buffers), so each buffer's range, rounded out to 2 MiB, is marked
``MADV_HUGEPAGE`` and then collapsed in place with ``MADV_COLLAPSE`` (Linux 6.1+): the kernel
copies it into huge pages at start-up, a one-off cost. Neighbouring heap memory inside
the rounded range is collapsed too, which only changes its page size.

The KV pool is asked for huge pages before it is zeroed (`zeros_on_huge_pages`), so its pages fault
in huge at no extra cost; decode attention reads scattered 4 KB blocks from it, and a decode step's
attention over a large pool measured faster on huge pages (`bench/paged_decode_kernel.py --step`,
docs/benchmarks.md "Huge pages").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Iterable
from pathlib import Path

import torch

MADV_HUGEPAGE = 14  # <linux/mman.h>
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_unavailable() -> str | None:
    """None when this process can ask for transparent huge pages, else why not."""
    if platform.system() != "Linux":
        return f"not Linux ({platform.system()})"
    try:
        mode = THP_ENABLED.read_text()
    except OSError as err:
        return f"cannot read {THP_ENABLED}: {err.strerror}"
    if "[never]" in mode:
        return f"transparent huge pages are off ({THP_ENABLED}: {mode.strip()})"
    return None


def merged_ranges(ranges: Iterable[tuple[int, int]], outward: bool = True) -> list[tuple[int, int]]:
    """(address, nbytes) ranges of at least half a huge page, rounded to huge-page boundaries (out, or in:
    only whole huge pages inside), overlapping ones merged: [(start, end)]. Smaller buffers are left
    alone: rounding them out would mostly collapse memory around them."""
    up = lambda x: (x + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)  # noqa: E731
    down = lambda x: x & ~(HUGE_PAGE - 1)  # noqa: E731
    spans = sorted((down(a), up(a + n)) if outward else (up(a), down(a + n)) for a, n in ranges if n >= HUGE_PAGE // 2)
    spans = [(start, end) for start, end in spans if end > start]
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def collapse_to_huge_pages(ranges: Iterable[tuple[int, int]]) -> tuple[int, str | None]:
    """Back the (address, nbytes) ranges of written memory with huge pages now: (bytes collapsed, None), or
    (bytes collapsed, why some or all could not be: no THP, a kernel before 6.1, no free huge pages)."""
    if why := thp_unavailable():
        return 0, why
    libc = _libc()
    done, failure = 0, None
    for start, end in merged_ranges(ranges):
        if _collapse(libc, start, end):
            done += end - start
            continue
        # one page of the rounded range could not be (not mapped: a buffer at the edge of its mapping; or no
        # free huge page just then): the range's pages one by one, so one failure costs one page, not the range
        for page in range(start, end, HUGE_PAGE):
            if _collapse(libc, page, page + HUGE_PAGE):
                done += HUGE_PAGE
            else:
                errno = ctypes.get_errno()
                failure = failure or f"madvise: {os.strerror(errno)} (errno {errno})"
    return done, failure


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """A zeroed CPU tensor whose whole 2 MiB pages are asked for as huge pages before anything touches them
    (``MADV_HUGEPAGE`` between allocating and zeroing: the pages fault in huge, nothing to collapse), and
    None, or why they could not be (it is still zeroed)."""
    tensor = torch.empty(shape, dtype=dtype)
    why = thp_unavailable()
    if why is None:
        libc = _libc()
        for start, end in merged_ranges([(tensor.data_ptr(), tensor.numel() * tensor.element_size())], outward=False):
            if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
                errno = ctypes.get_errno()
                why = f"madvise: {os.strerror(errno)} (errno {errno})"
    return tensor.zero_(), why


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return libc


def _collapse(libc: ctypes.CDLL, start: int, end: int) -> bool:
    return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0 and libc.madvise(start, end - start, MADV_COLLAPSE) == 0
