"""`model.huge_pages`: packed weights collapsed into 2 MiB transparent huge pages (sage_infer/hal/huge_pages.py).

The rounding is checked as arithmetic; the collapse on a real buffer of this process, read back from
/proc/self/smaps (skipped, saying why, where the kernel cannot: THP off, or no MADV_COLLAPSE before
Linux 6.1); the engine's use of the setting by which ranges it hands over."""

from __future__ import annotations

import pytest
import torch

from sage_infer.config.serve import ServeConfig
from sage_infer.engine import build
from sage_infer.hal.huge_pages import HUGE_PAGE, collapse_to_huge_pages, merged_ranges
from sage_infer.layers.linear import PackedLinear, packing_available
from tests.tiny_models import make_tiny_model

MB = 1 << 20


def test_ranges_are_rounded_to_huge_pages_and_merged():
    h = HUGE_PAGE
    ranges = [(h + 100, h // 2), (h + 4000, h), (5 * h, 3 * h), (9 * h - 1, h // 2 + 2), (20 * h, h // 2 - 1)]
    assert merged_ranges(ranges) == [(h, 3 * h), (5 * h, 10 * h)]  # 8h-10h joins 5h-8h; the last is too small
    assert merged_ranges(ranges, outward=False) == [(5 * h, 8 * h)]  # only whole pages inside a buffer


def smaps_field(address: int, nbytes: int, field: str) -> list[str]:
    """`field`'s value in each mapping that overlaps [address, address + nbytes) (/proc/self/smaps; madvise
    splits a mapping where its advice changes)."""
    values, inside = [], False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < address + nbytes and address < end
        elif inside and head == f"{field}:":
            values.append(line.split(None, 1)[1].strip())
    return values


def anon_huge_kb(address: int, nbytes: int) -> int:
    """AnonHugePages (KiB) of the mappings that overlap [address, address + nbytes)."""
    return sum(int(v.split()[0]) for v in smaps_field(address, nbytes, "AnonHugePages"))


def test_a_written_buffer_is_collapsed_in_place_and_keeps_its_values():
    buf = torch.arange(12 * MB // 4, dtype=torch.int32)  # written, 12 MiB: glibc maps it on its own
    before = buf.clone()
    done, why = collapse_to_huge_pages([(buf.data_ptr(), buf.numel() * 4)])
    if done == 0:
        pytest.skip(f"this kernel does not collapse into huge pages: {why}")
    assert anon_huge_kb(buf.data_ptr(), buf.numel() * 4) >= 8 * 1024  # at least the 4 whole pages inside the buffer
    assert torch.equal(buf, before)


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN (mkldnn) linear")
@pytest.mark.parametrize("enabled", [True, False])
def test_the_engine_hands_over_every_packed_weight_only_when_enabled(tmp_path, monkeypatch, enabled):
    calls = []
    monkeypatch.setattr(build, "collapse_to_huge_pages", lambda ranges: calls.append(list(ranges)) or (0, "test"))
    path = make_tiny_model(tmp_path / "llama", "llama")
    config = ServeConfig.model_validate({"model": {"path": str(path), "huge_pages": enabled},
                                         "kv_pool": {"num_blocks": 8}})
    engine = build.build_engine(config)
    packed = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed
    if not enabled:
        assert calls == []
        return
    (ranges,) = calls
    assert sorted(ranges) == sorted((torch.ops.mkldnn.data_ptr(m.packed), torch.ops.mkldnn._nbytes(m.packed))
                                    for m in packed)


def test_a_pool_built_with_huge_pages_is_zero_and_on_huge_pages():
    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.hal.huge_pages import thp_unavailable
    from sage_infer.kv_runtime import KVPool

    schema = KVCacheSchema(4, 2, 64, 16, KVDtype.BF16)  # 32 KiB per block
    pool = KVPool(schema, 2048, huge_pages=True)  # 64 MiB: above glibc's mmap threshold, so freshly mapped
    assert not pool._kv.any()
    if why := thp_unavailable():
        pytest.skip(f"no transparent huge pages here: {why}")
    address, nbytes = pool._kv.data_ptr(), pool._kv.numel() * 2
    flags = smaps_field(address, nbytes, "VmFlags")
    assert flags and any("hg" in f.split() for f in flags)  # the pool's pages carry MADV_HUGEPAGE
    # how many 2 MiB pages the kernel grants depends on its free memory (a fragmented machine gives fewer)
    if anon_huge_kb(address, nbytes) == 0:
        pytest.skip("the kernel gave no huge page (memory fragmented)")
