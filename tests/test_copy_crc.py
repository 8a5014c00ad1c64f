"""The one-pass copy + CRC32C (csrc/kv_codec.cpp `copy_crc32c` / `copy_rows_crc32c`, `kv_codec_kernel`): at every
ISA level built for this architecture that this CPU runs, the copy equals a plain copy and its CRC equals the
`crc32c` package's, for every length from 0 to 200 bytes, odd source and destination offsets, lengths around the
kernel's interleaved blocks, 16 KiB and 2 MiB + 3, with plain and streaming stores; nothing outside the
destination is written; a batch of row runs returns one CRC per row; and without the kernel the Python fallback
gives the same bytes and CRCs. Every CRC method the kernel runs here (carry-less-multiply folding at 16, 32 and
64 bytes, the crc32 instruction) gives the bitwise definition's CRC for lengths 0..300 and long odd ones, at odd
offsets, chained; the method chosen by default is the one /proc/cpuinfo's flags allow."""

from __future__ import annotations

import itertools

import crc32c
import numpy as np
import pytest
import torch

from sage_infer.errors import ConfigError
from sage_infer.hal.isa import build_levels, missing_flags, read_cpu_flags, selected_level
from sage_infer.quantization import kv_codec_kernel
from sage_infer.quantization.kv_codec_kernel import CODEC_ENV, crc_method_forced

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


@pytest.mark.parametrize("level", build_levels())
def test_a_large_batch_split_over_threads_is_the_one_thread_copy(level, monkeypatch):
    """`threads` cuts the batch's rows into ranges, one per thread (at least 1 MiB each): every row is copied and
    checksummed once, into its own place, with its CRC at its own index, whatever the split and the runs."""
    module = fused_at(level, monkeypatch)
    row = (64 << 10) + 24  # (not a multiple of a vector)
    src = torch.randint(0, 256, (90, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    # runs out of order, one empty, one row long, crossing where a split would fall
    runs = torch.tensor([(60, 0, 31), (0, 40, 0), (3, 31, 1), (10, 45, 45), (91, 32, 8)])
    expected = [crc32c.crc32c(src[s + i].numpy()) for _, s, n in runs.tolist() for i in range(n)]
    for threads, stream, spawn in itertools.product((1, 2, 3, 7, 200), (0, 1), (False, True)):
        case = (threads, stream, spawn)  # (spawn: threads started for the call, not the caller's OpenMP team)
        dst = torch.full((100, row), SENTINEL, dtype=torch.uint8)
        assert module.copy_rows_crc32c(dst, src, runs, stream, threads, spawn).tolist() == expected, case
        for d, s, n in runs.tolist():
            assert torch.equal(dst[d : d + n], src[s : s + n]), (case, d)
        named = {d + i for d, _, n in runs.tolist() for i in range(n)}
        untouched = [r for r in range(100) if r not in named]
        assert bool((dst[untouched] == SENTINEL).all()), case
    with pytest.raises(RuntimeError, match="threads must be >= 1"):
        module.copy_rows_crc32c(dst, src, runs, -1, 0)


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
    copy = kv_codec_kernel.array_copier()  # the same, the kernel chosen once (a transport connection's)
    if with_kernel:
        assert got == crc32c.crc32c(read_only) and np.array_equal(target, read_only)
        again = np.zeros_like(read_only)
        assert copy(again[3:], read_only[3:], 5, 1) == crc32c.crc32c(read_only[3:], 5)
        assert np.array_equal(again[3:], read_only[3:]) and not again[:3].any()
    else:
        assert got is None and not target.any()  # the caller copies and checksums on its own
        assert copy is None


def bitwise_crc32c(data: bytes, crc: int = 0) -> int:
    """CRC32C by its definition: reflected polynomial 0x82F63B78, pre- and post-inverted, one bit at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


# around the folding's thresholds (512 bytes, 4 and 8 vectors, a vector's tail) and long odd lengths
LONG_SIZES = (511, 512, 513, 575, 1023, 1024 + 15, 4096 + 63, 16383, (256 << 10) + 7, (2 << 20) + 61)


def test_the_folding_agrees_with_the_bitwise_definition(cpu_isa):
    if kv_codec_kernel.fused_copy() is None or not hasattr(kv_codec_kernel.native(), "crc32c_methods"):
        pytest.skip(f"no CRC32C kernel here: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    data = bytes(np.random.default_rng(5).integers(0, 256, 1400, dtype=np.uint8))
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for method in kv_codec_kernel.native().crc32c_methods():
        with crc_method_forced(method) as module:
            for n, off in ((1400, 0), (1337, 3), (700, 61), (512, 1)):
                expected = bitwise_crc32c(data[off : off + n], 0x1234567)
                assert module.crc32c(src[off : off + n], 0x1234567) == expected, (cpu_isa, method, n, off)
                out = torch.empty(n + 64, dtype=torch.uint8)
                assert module.copy_crc32c(out[5 : 5 + n], src[off : off + n], 0x1234567, 0) == expected


def test_every_crc_method_copies_and_checksums_any_length_and_offset(cpu_isa):
    if kv_codec_kernel.fused_copy() is None or not hasattr(kv_codec_kernel.native(), "crc32c_methods"):
        pytest.skip(f"no CRC32C kernel here: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, ((2 << 20) + 200,), dtype=torch.uint8, generator=gen)
    dst = torch.empty((2 << 20) + 200, dtype=torch.uint8)
    for method in kv_codec_kernel.native().crc32c_methods():
        with crc_method_forced(method) as module:
            for n in (*range(301), *LONG_SIZES):
                so, do = n % 7, (3 * n + 1) % 64 if n % 2 else 0
                seed = (n * 2654435761) & 0xFFFFFFFF
                part = src[so : so + n]
                expected = crc32c.crc32c(part.numpy(), seed)
                assert module.crc32c(part, seed) == expected, (cpu_isa, method, n, so)
                stream = n % 2 if n < 300 else -1
                dst[do : do + n + 64].fill_(SENTINEL)
                assert module.copy_crc32c(dst[do : do + n], part, seed, stream) == expected, (cpu_isa, method, n)
                assert torch.equal(dst[do : do + n], part) and bool((dst[do + n : do + n + 64] == SENTINEL).all())
            # a CRC chained over cuts (each continuing the last) is the whole input's
            whole, crc = src[1 : 1 + (1 << 20) + 77], 0
            for a, b in ((0, 700), (700, 701), (701, 5000), (5000, (1 << 20) + 77)):
                crc = module.copy_crc32c(dst[a + 3 : b + 3], whole[a:b], crc, 0)
            assert crc == crc32c.crc32c(whole.numpy()), (cpu_isa, method)


def test_the_default_crc_method_is_what_the_cpu_flags_allow(cpu_isa):
    module = kv_codec_kernel.native()
    if module is None or not hasattr(module, "crc32c_methods") or not module.crc32c_native():
        pytest.skip(f"no CRC32C kernel here: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    flags = read_cpu_flags() or set()
    wide = "vpclmulqdq" in flags and "pclmulqdq" in flags
    expected = ("crc32" if not wide else "vpclmulqdq-256" if cpu_isa == "avx2" else "vpclmulqdq-512")
    assert module.crc32c_method() == kv_codec_kernel.crc_method() == expected
    assert ("pclmulqdq" in module.crc32c_methods()) == ("pclmulqdq" in flags)
    with pytest.raises(RuntimeError, match="unknown method"):
        module.crc32c_set_method("crc64")


def test_sage_crc32c_forces_a_method_and_refuses_one_this_cpu_lacks(monkeypatch):
    module = kv_codec_kernel.native()
    if module is None or not hasattr(module, "crc32c_methods") or not module.crc32c_native():
        pytest.skip(f"no CRC32C kernel here: {kv_codec_kernel.unavailable() or 'CRC not native'}")
    before = module.crc32c_method()
    try:
        monkeypatch.setattr(kv_codec_kernel, "_checked", set())  # (the env is read at a build's first load)
        monkeypatch.setenv(kv_codec_kernel.CRC_ENV, "crc32")
        assert kv_codec_kernel.crc_method() == "crc32"
        monkeypatch.setattr(kv_codec_kernel, "_checked", set())
        monkeypatch.setenv(kv_codec_kernel.CRC_ENV, "crc64")
        with pytest.raises(ConfigError, match="SAGE_CRC32C=crc64: not a CRC32C method"):
            kv_codec_kernel.native()
    finally:
        module.crc32c_set_method(before)
