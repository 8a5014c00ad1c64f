"""The CPU's instruction-set level, read at run time, for choosing which build of the C++ kernels to load.

The kernels (sage_infer/layers/csrc) are compiled once per level, never with ``-march=native``, so one
install runs on any x86-64 CPU and no build executes an instruction the CPU lacks:

- ``avx2``: AVX2 + FMA + F16C, the baseline (every x86-64 server CPU since ~2013, and desktops); flash attention
  in fp32 (bf16 widened to it);
- ``avx512``: adds AVX-512 F/BW/VL/DQ (16-lane fp32 flash attention and paged decode);
- ``avx512_bf16``: adds AVX512-BF16 dot products (bf16 flash attention on them, the small-row bf16 product, the
  C++ decode step that chains it).

No sage kernel uses AMX tiles, so there is no AMX level (oneDNN uses AMX by itself where the CPU has it).
Other architectures (aarch64, ...) get one ``generic`` build with the compiler's default flags.

``SAGE_CPU_ISA=avx2|avx512|avx512_bf16`` forces a level at or below the CPU's (for tests and benchmarks of the
lower paths on a faster machine); a level the CPU lacks is a `ConfigError`, since it would crash on the first
unsupported instruction.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from sage_infer.errors import ConfigError

X86_LEVELS = ("avx2", "avx512", "avx512_bf16")
GENERIC = "generic"
# what each level adds to the one below: Linux's /proc/cpuinfo flag names, which it lists only when the OS
# also saves the registers (AVX-512 state in XCR0), and the compiler flags that enable the same instructions
LEVEL_CPU_FLAGS = {
    "avx2": ("avx", "avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
}
LEVEL_COMPILE_FLAGS = {
    "avx2": ("-mavx", "-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16",),
}
ENV = "SAGE_CPU_ISA"


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686", "x86")


def build_levels(machine: str | None = None) -> tuple[str, ...]:
    """The levels the kernels are built for on this architecture (lowest first)."""
    return X86_LEVELS if is_x86(machine) else (GENERIC,)


def compile_flags(level: str) -> list[str]:
    """Compiler flags that enable the instructions of `level` (and of every level below it)."""
    if level == GENERIC:
        return []
    flags: list[str] = []
    for name in X86_LEVELS[: X86_LEVELS.index(level) + 1]:
        flags += LEVEL_COMPILE_FLAGS[name]
    return flags


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The first processor's ``flags`` (x86) or ``Features`` (arm64) in `cpuinfo`; None where the file cannot be
    read or has neither."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def missing_flags(level: str, flags: set[str]) -> list[str]:
    """The CPU flags `level` needs (its own and those of the levels below) that `flags` lacks."""
    needed = [f for name in X86_LEVELS[: X86_LEVELS.index(level) + 1] for f in LEVEL_CPU_FLAGS[name]]
    return [f for f in needed if f not in flags]


def detected_level(flags: set[str] | None, machine: str | None = None) -> str | None:
    """The highest level whose instructions the CPU has (`flags` from `read_cpu_flags`); ``generic`` off x86;
    None on an x86 CPU without AVX2 + FMA, or where the flags could not be read (then no x86 build is safe to
    assume)."""
    if not is_x86(machine):
        return GENERIC
    if flags is None:
        return None
    best = None
    for level in X86_LEVELS:
        if missing_flags(level, flags):
            break
        best = level
    return best


def selected_level(env: dict[str, str] | None = None, flags: set[str] | None = None,
                   machine: str | None = None) -> tuple[str | None, str]:
    """(level to load, why) from the CPU (`flags`, read from /proc/cpuinfo when None) and ``SAGE_CPU_ISA``.
    The level is None when no build can run here; `why` then says why. ConfigError for a ``SAGE_CPU_ISA``
    that is unknown or above what the CPU has."""
    env = os.environ if env is None else env
    if flags is None and is_x86(machine):
        flags = read_cpu_flags()
    cpu = detected_level(flags, machine)
    forced = env.get(ENV, "").strip().lower()
    if not forced:
        if cpu is None:
            why = ("the CPU flags could not be read (/proc/cpuinfo)" if flags is None
                   else f"this CPU lacks {', '.join(missing_flags('avx2', flags))} (the kernels' lowest level is avx2)")
            return None, why
        return cpu, "the highest level this CPU has"
    levels = build_levels(machine)
    if forced not in levels:
        hint = " (no sage kernel uses AMX tiles; avx512_bf16 is the highest level)" if forced == "amx" else ""
        raise ConfigError(f"{ENV}={forced}: not a level of this machine's kernels; one of {', '.join(levels)}{hint}")
    if cpu is None or levels.index(forced) > levels.index(cpu):
        lacks = ", ".join(missing_flags(forced, flags)) if flags is not None else "readable CPU flags"
        raise ConfigError(f"{ENV}={forced}: this CPU lacks {lacks}; it runs {cpu or 'no kernel build'}",
                          hint=f"unset {ENV} or set a lower level")
    return forced, f"forced by {ENV}"
