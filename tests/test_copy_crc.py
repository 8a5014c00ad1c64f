"""The one-pass copy + CRC32C (csrc/kv_codec.cpp `copy_crc32c` / `copy_rows_crc32c`, `kv_codec_kernel`): at every
ISA level built for this architecture that this CPU runs, the copy equals a plain copy and its CRC equals the
`crc32c` package's, for every length from 0 to 200 bytes, odd source and destination offsets, lengths around the
kernel's interleaved blocks, 16 KiB and 2 MiB + 3, with plain and streaming stores; nothing outside the
destination is written; a batch of row runs returns one CRC per row; and without the kernel the Python fallback
gives the same bytes and CRCs."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch

from sage_infer.hal.isa import build_levels, missing_flags, read_cpu_flags, selected_level
from sage_infer.quantization import kv_codec_kernel
from sage_infer.quantization.kv_codec_kernel import CODEC_ENV

# every length up to 200 (the unaligned head and the 8-byte tail), around the 3 x 256 and 3 x 8 KiB blocks the
# three streams take, and large
SIZES = [*range(201), 767, 768, 769, 16 << 10, (24 << 10) - 1, 24 << 10, (24 << 10) + 1, (2 << 20) + 3]
OFFSETS = ((0, 0), (1, 0), (3, 5), (7, 1), (0, 3))  # (source, destination)
SENTINEL = 0xA5


def fused_at(level: str, monkeypatch):
    """The kernel module of `level`, forced with SAGE_CPU_ISA; skipped (saying why) where it cannot run here."""
    flags = read_cpu_flags()
    top, _ = selected_level({})
    if top is None or flags is None:
        pytest.skip("no CPU kernel level runs on this CPU")
    levels = build_levels()
    if levels.index(level) > levels.index(top):
        pytest.skip(f"this CPU lacks {', '.join(missing_flags(level, flags)) or level} for the {level} build")
    monkeypatch.setenv("SAGE_CPU_ISA", level)
    module = kv_codec_kernel.fused_copy()
    if module is None:
        pytest.skip(f"no one-pass copy kernel at {level}: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    return module


@pytest.mark.parametrize("level", build_levels())
def test_one_pass_copy_is_a_copy_and_the_crc32c_packages_crc(level, monkeypatch):
    module = fused_at(level, monkeypatch)
    src = torch.randint(0, 256, ((2 << 20) + 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.empty((2 << 20) + 80, dtype=torch.uint8)
    for n in SIZES:
        for k, (so, do) in enumerate(OFFSETS):
            stream = (-1, 0, 1)[(n + k) % 3] if n < (1 << 20) else k % 3 - 1  # plain, streamed and chosen by size
            start = (n * 2654435761 + k) & 0xFFFFFFFF  # a CRC to continue
            dst.fill_(SENTINEL)
            got = module.copy_crc32c(dst[do : do + n], src[so : so + n], start, stream)
            assert got == crc32c.crc32c(src[so : so + n].numpy(), start), (level, n, so, do, stream)
            assert torch.equal(dst[do : do + n], src[so : so + n]), (level, n, so, do, stream)
            assert bool((dst[:do] == SENTINEL).all()) and bool((dst[do + n : do + n + 64] == SENTINEL).all())


@pytest.mark.parametrize("level", build_levels())
def test_a_batch_of_row_runs_is_copied_with_one_crc_per_row(level, monkeypatch):
    module = fused_at(level, monkeypatch)
    for row_bytes in (1, 13, 4096 + 5, 16 << 10):
        src = torch.randint(0, 256, (9, row_bytes), dtype=torch.uint8)
        dst = torch.full((12, row_bytes), SENTINEL, dtype=torch.uint8)
        runs = [(0, 3, 2), (5, 0, 3), (11, 8, 1), (4, 4, 0)]
        for stream in (0, 1):
            crcs = module.copy_rows_crc32c(dst, src, torch.tensor(runs), stream).tolist()
            assert crcs == [crc32c.crc32c(src[s + i].numpy()) for _, s, n in runs for i in range(n)]
            for d, s, n in runs:
                assert torch.equal(dst[d : d + n], src[s : s + n])
            assert bool((dst[[2, 3, 4, 8, 9, 10]] == SENTINEL).all())  # rows no run names stay untouched
    # rows with a stride (a slice of a wider tensor), and an empty batch
    wide = torch.randint(0, 256, (4, 100), dtype=torch.uint8)
    out = torch.zeros(4, 60, dtype=torch.uint8)
    assert module.copy_rows_crc32c(out, wide[:, 20:80], torch.tensor([(0, 0, 4)])).tolist() == [
        crc32c.crc32c(row) for row in wide[:, 20:80].numpy()]
    assert torch.equal(out, wide[:, 20:80])
    assert module.copy_rows_crc32c(out, wide[:, 20:80], torch.zeros((0, 3), dtype=torch.long)).numel() == 0
    with pytest.raises(RuntimeError, match="outside"):
        module.copy_rows_crc32c(out, wide[:, 20:80], torch.tensor([(2, 0, 3)]))


@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "fallback"])
def test_the_python_entry_points_agree_with_and_without_the_kernel(with_kernel, monkeypatch):
    if not with_kernel:
        monkeypatch.setenv(CODEC_ENV, "torch")
    elif kv_codec_kernel.fused_copy() is None:
        pytest.skip(f"no one-pass copy kernel here: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    src = torch.randint(0, 256, (7, 3001), dtype=torch.uint8)
    dst = torch.zeros(9, 3001, dtype=torch.uint8)
    runs = [(2, 0, 3), (0, 5, 2)]
    expected = [crc32c.crc32c(src[s + i].numpy()) for _, s, n in runs for i in range(n)]
    assert kv_codec_kernel.copy_rows_crc32c(dst, src, runs) == expected
    assert torch.equal(dst[2:5], src[0:3]) and torch.equal(dst[0:2], src[5:7])
    flat, into = src.reshape(-1)[1:], torch.zeros(src.numel() - 1, dtype=torch.uint8)
    assert kv_codec_kernel.copy_crc32c(into, flat, 9) == crc32c.crc32c(flat.numpy(), 9)
    assert torch.equal(into, flat)
    read_only = np.frombuffer(bytes(src.reshape(-1).numpy()), dtype=np.uint8)  # a sender's bytes
    target = np.zeros_like(read_only)
    got = kv_codec_kernel.copy_crc32c_array(target, read_only)
    if with_kernel:
        assert got == crc32c.crc32c(read_only) and np.array_equal(target, read_only)
    else:
        assert got is None and not target.any()  # the caller copies and checksums on its own
