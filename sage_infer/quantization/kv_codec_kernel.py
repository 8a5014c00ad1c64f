"""The KV codec's C++ kernel (sage_infer/layers/csrc/kv_codec.cpp) and the CRC32C it computes as it encodes.

The kernel is part of the CPU kernels' build (one per ISA level, compiled at install, the highest the CPU runs
loaded at run time: `sage_infer.hal.kernel_build`). It encodes and decodes exactly as the PyTorch codec
(`kv_codec.quantize_groups` / `dequantize_groups`, the reference its tests compare with bit for bit), reading the
fp16 / bf16 / fp32 values once: no fp32 copy, no temporaries. With ``crc`` it also returns the CRC32C of the bytes
it wrote (codes, then scales), computed while they are in L1 or L2, so a checksummed wire chunk
costs no second pass over its payload.

`native()` is the module, or None where it cannot run: no kernel build loads here, the build predates the codec,
or ``SAGE_KV_CODEC=torch`` asks for the PyTorch codec. The reason is logged once; the callers then take the
PyTorch codec and the `crc32c` package (so does the CRC of the generic, non-x86 build, `native_crc()`).
`crc32c()` is the package's function on the kernel's loop (the same values); `copy_crc32c()` and
`copy_rows_crc32c()` copy and checksum in one pass (each byte loaded once), the data path's moves (tier puts and
gets, shm sends and receives).

How the kernel computes a long CRC (`crc_method()`): ``vpclmulqdq-512`` (carry-less-multiply folding of 64-byte
vectors, the AVX-512 builds), ``vpclmulqdq-256`` (32-byte vectors, the avx2 build), where the CPU has VPCLMULQDQ;
else ``crc32`` (the SSE4.2 instruction in three streams). ``pclmulqdq`` (16-byte vectors) runs where the CPU has
PCLMULQDQ but is chosen only by `crc_method_forced` or ``SAGE_CRC32C=<method>`` (read at the first load). The
kernel asks the CPU (cpuid) and the first load checks its choice against /proc/cpuinfo's flags, falling back to
``crc32`` where they disagree. Below 512 bytes, and for the head and tail of longer inputs, the crc32 instruction
runs.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import crc32c as _crc32c
import numpy as np
import torch

from sage_infer.errors import ConfigError
from sage_infer.hal import kernel_build
from sage_infer.hal.isa import ENV, read_cpu_flags

log = logging.getLogger(__name__)
FORMAT_CODES = {"fp8_e4m3": 0, "fp8_e5m2": 1, "fp8_e4m3fnuz": 2, "int8": 3, "int4": 4}
CRC_ENV = "SAGE_CRC32C"  # a CRC method to force at the kernel's first load (crc32, pclmulqdq, vpclmulqdq-256/-512)
CODEC_ENV = "SAGE_KV_CODEC"  # "torch": the PyTorch codec where the kernel would load (tests, benchmarks)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_logged: set[str] = set()
# /proc/cpuinfo flags each folding method needs (the kernel asks cpuid; a disagreement falls back to crc32)
METHOD_CPU_FLAGS = {"pclmulqdq": ("pclmulqdq",), "vpclmulqdq-256": ("pclmulqdq", "vpclmulqdq"),
                    "vpclmulqdq-512": ("pclmulqdq", "vpclmulqdq", "avx512f")}
_checked: set[int] = set()


def unavailable() -> str | None:
    """None when the kernel runs here, else why not (loads the CPU kernels' build on the first call)."""
    if os.environ.get(CODEC_ENV, "").strip().lower() == "torch":
        return f"{CODEC_ENV}=torch"
    module, why, _ = kernel_build.load_selected(os.environ.get(ENV, ""))
    if module is not None and not hasattr(module, "kv_encode"):
        return "the loaded CPU kernel build predates the KV codec kernel (run `make install`)"
    return why


def native() -> ModuleType | None:
    """The kernel module, or None (the reason logged once per reason) where the PyTorch codec runs instead."""
    why = unavailable()
    if why is None:
        module = kernel_build.load_selected(os.environ.get(ENV, ""))[0]
        if id(module) not in _checked:
            _checked.add(id(module))
            _check_crc_method(module)
        return module
    if why not in _logged:
        _logged.add(why)
        log.info("sage: the KV codec runs on PyTorch ops, not its C++ kernel: %s", why)
    return None


def _check_crc_method(module: ModuleType) -> None:
    """Fall back to the crc32 instruction where /proc/cpuinfo lacks a flag the kernel's folding method needs."""
    if not hasattr(module, "crc32c_method"):
        return
    forced = os.environ.get(CRC_ENV, "").strip().lower()
    if forced:  # (a benchmark's old-vs-new runs across processes)
        if forced not in module.crc32c_methods():
            raise ConfigError(f"{CRC_ENV}={forced}: not a CRC32C method this kernel build runs on this CPU; one "
                              f"of {', '.join(module.crc32c_methods())}")
        module.crc32c_set_method(forced)
    method, flags = module.crc32c_method(), read_cpu_flags()
    missing = [f for f in METHOD_CPU_FLAGS.get(method, ()) if flags is None or f not in flags]
    if missing:
        log.info("sage: CRC32C on the crc32 instruction, not %s: /proc/cpuinfo lacks %s", method, ", ".join(missing))
        module.crc32c_set_method("crc32")


def crc_method() -> str | None:
    """How the kernel computes a long CRC32C (see the module's docstring), or None where it does not run."""
    module = native_crc()
    return module.crc32c_method() if module is not None and hasattr(module, "crc32c_method") else None


@contextmanager
def crc_method_forced(method: str) -> Iterator[ModuleType]:
    """The kernel module with its CRC32C computed by `method` (one of its ``crc32c_methods()``) until the block
    ends: the benchmarks' old-vs-new rounds and the tests of every method. RuntimeError where it does not run."""
    module = native_crc()
    if module is None or not hasattr(module, "crc32c_set_method"):
        raise RuntimeError(f"no CRC32C kernel with methods here: {unavailable() or 'CRC not native'}")
    before = module.crc32c_method()
    module.crc32c_set_method(method)
    try:
        yield module
    finally:
        module.crc32c_set_method(before)


def kernel_for(device: torch.device, dtype: torch.dtype, fmt: str, group: int, inner: int) -> ModuleType | None:
    """The kernel for values of `dtype` on `device` viewed as [outer, group, inner] in `fmt`, or None where the
    PyTorch codec must run (another device or dtype, an int4 unit or row of odd length, or no kernel here)."""
    if device.type != "cpu" or dtype not in _KERNEL_DTYPES or fmt not in FORMAT_CODES:
        return None
    if fmt == "int4" and ((group * inner) % 2 or (inner > 1 and inner % 2)):
        return None
    return native()


def native_crc() -> ModuleType | None:
    """The kernel module where its CRC32C runs on the CPU's instruction (SSE4.2 ``crc32``: every x86-64 build),
    else None (the generic build's CRC is a bitwise loop: the `crc32c` package checksums instead)."""
    module = native()
    return module if module is not None and module.crc32c_native() else None


def crc32c(data: torch.Tensor, value: int = 0) -> int:
    """CRC32C of a contiguous CPU tensor's bytes, continuing `value` (as ``crc32c.crc32c(data, value)``)."""
    module = native_crc()
    if module is not None:
        return module.crc32c(data, value)
    return _crc32c.crc32c(memoryview(data.reshape(-1).view(torch.uint8).numpy()), value)


def copy_crc32c(dst: torch.Tensor, src: torch.Tensor, value: int = 0) -> int:
    """``dst.copy_(src)`` (contiguous CPU tensors of equal bytes) and the CRC32C of the bytes, continuing `value`:
    the kernel loads each byte once, stores it and folds it into the CRC (`crc_method`; one pass, the GIL
    released; streaming stores from 1 MiB); elsewhere a copy, then the CRC."""
    module = native_crc()
    if module is not None:
        return module.copy_crc32c(dst, src, value)
    dst.copy_(src)
    return crc32c(src, value)


def fused_copy() -> ModuleType | None:
    """The kernel module whose ``copy_rows_crc32c`` / ``copy_crc32c`` copy and checksum in one pass with the GIL
    released, or None where the CRC would not run on the CPU's instruction or the build predates them."""
    module = native_crc()
    return module if module is not None and hasattr(module, "copy_rows_crc32c") else None


def copy_rows_crc32c(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]]) -> list[int]:
    """``dst[d + i] = src[s + i]`` for each run (d, s, n) and i < n, over the rows of 2-D uint8 CPU tensors of
    equal row bytes (each row contiguous), and the CRC32C of each copied row in run order (the `crc32c` package's
    value). One kernel call for the whole batch, one pass over its bytes; elsewhere a copy per run, then a CRC per
    row."""
    module = fused_copy()
    if module is not None:
        return module.copy_rows_crc32c(dst, src, torch.tensor(runs, dtype=torch.long).reshape(-1, 3)).tolist()
    out: list[int] = []
    for d, s, n in runs:
        dst[d : d + n].copy_(src[s : s + n])
        out += [_crc32c.crc32c(row) for row in dst[d : d + n].numpy()]
    return out


def crc32c_array(data: np.ndarray, value: int = 0) -> int | None:
    """`crc32c` of a 1-D uint8 numpy array (read-only too) on the kernel, or None where it does not load."""
    module = native_crc()
    if module is None:
        return None
    return module.crc32c(_source(data), value)


ArrayCopy = Callable[[np.ndarray, np.ndarray, int, int], int]


def array_copier() -> ArrayCopy | None:
    """`copy_crc32c_array` with the kernel chosen once, now, instead of at every call (choosing reads three
    environment variables: 5-10 µs, a tenth of what a shm chunk's sender spends on it besides the copy): for a
    caller that copies many chunks with the kernel it started with, such as a transport connection. Call it as
    ``copy(dst, src, value, stream)``; None where the one-pass kernel does not load."""
    module = fused_copy()
    if module is None:
        return None
    kernel = module.copy_crc32c

    def copy(dst: np.ndarray, src: np.ndarray, value: int = 0, stream: int = -1) -> int:
        return kernel(torch.from_numpy(dst), _source(src), value, stream)

    return copy


def _source(src: np.ndarray) -> torch.Tensor:
    """`src` as a tensor, read-only arrays too (torch warns that such a one is shared; it is only read)."""
    if src.flags.writeable:
        return torch.from_numpy(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(src)


def copy_crc32c_array(dst: np.ndarray, src: np.ndarray, value: int = 0, stream: int = -1) -> int | None:
    """`copy_crc32c` of 1-D uint8 numpy arrays (`src` may be read-only, a view of a sender's bytes), or None,
    copying nothing, where the one-pass kernel does not load. `stream`: 1 streaming stores (the destination is
    not read back soon), 0 plain stores (it is: they leave it in cache), -1 streaming from 1 MiB."""
    module = fused_copy()
    if module is None:
        return None
    return module.copy_crc32c(torch.from_numpy(dst), _source(src), value, stream)
