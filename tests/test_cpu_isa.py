"""The CPU's ISA level (`sage_infer.hal.isa`): read from /proc/cpuinfo, capped by ``SAGE_CPU_ISA``, and the kernel
build that level loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from sage_infer.errors import ConfigError
from sage_infer.hal.isa import (
    X86_LEVELS,
    compile_flags,
    detected_level,
    missing_flags,
    read_cpu_flags,
    selected_level,
)

DATA = Path(__file__).parent / "data" / "cpuinfo"
AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}


def test_an_avx2_epyc_captured_from_proc_cpuinfo_is_the_avx2_level():
    flags = read_cpu_flags(DATA / "epyc_zen3_avx2.txt")  # an AMD EPYC (Zen 3) VM: AVX2, no AVX-512
    assert {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags
    assert detected_level(flags, "x86_64") == "avx2"
    assert missing_flags("avx512", flags) == ["avx512f", "avx512bw", "avx512vl", "avx512dq"]


@pytest.mark.parametrize("flags, level", [(AVX2, "avx2"), (AVX512, "avx512"), (AVX512_BF16, "avx512_bf16"),
                                          (AVX512_BF16 | {"amx_tile", "amx_bf16"}, "avx512_bf16"),
                                          ({"sse4_2", "avx"}, None),  # no AVX2: no build is safe
                                          (AVX2 - {"fma"}, None),
                                          # bf16 without the AVX-512 base (never seen; the levels are cumulative)
                                          (AVX2 | {"avx512_bf16"}, "avx2")])
def test_the_level_is_the_highest_whose_flags_and_all_below_are_present(flags, level):
    assert detected_level(flags, "x86_64") == level


def test_other_architectures_have_one_generic_build():
    assert detected_level(None, "aarch64") == "generic"
    assert selected_level({}, None, "aarch64") == ("generic", "the highest level this CPU has")
    assert compile_flags("generic") == []


def test_each_level_compiles_with_its_flags_and_those_below_never_march_native():
    assert compile_flags("avx2") == ["-mavx", "-mavx2", "-mfma", "-mf16c"]
    assert compile_flags("avx512_bf16")[:4] == compile_flags("avx2")
    assert "-mavx512bf16" in compile_flags("avx512_bf16") and "-mavx512bf16" not in compile_flags("avx512")
    assert not any("march" in f for level in X86_LEVELS for f in compile_flags(level))


def test_sage_cpu_isa_forces_a_lower_level():
    assert selected_level({"SAGE_CPU_ISA": "avx2"}, AVX512_BF16, "x86_64") == ("avx2", "forced by SAGE_CPU_ISA")
    assert selected_level({"SAGE_CPU_ISA": "AVX512"}, AVX512_BF16, "x86_64")[0] == "avx512"
    assert selected_level({}, AVX512_BF16, "x86_64")[0] == "avx512_bf16"


def test_sage_cpu_isa_above_the_cpu_is_a_config_error_naming_what_it_lacks():
    with pytest.raises(ConfigError, match="^SAGE_CPU_ISA=avx512_bf16: this CPU lacks avx512_bf16; it runs avx512$"):
        selected_level({"SAGE_CPU_ISA": "avx512_bf16"}, AVX512, "x86_64")
    with pytest.raises(ConfigError, match="^SAGE_CPU_ISA=avx2: this CPU lacks avx2, fma"):
        selected_level({"SAGE_CPU_ISA": "avx2"}, {"avx", "f16c"}, "x86_64")


@pytest.mark.parametrize("value, hint", [("sse4", ""), ("amx", "no sage kernel uses AMX tiles")])
def test_an_unknown_sage_cpu_isa_is_a_config_error_listing_the_levels(value, hint):
    with pytest.raises(ConfigError, match=f"^SAGE_CPU_ISA={value}: not a level .*avx2, avx512, avx512_bf16.*{hint}"):
        selected_level({"SAGE_CPU_ISA": value}, AVX512_BF16, "x86_64")


def test_without_avx2_no_kernel_build_is_chosen_and_the_reason_names_the_missing_flags():
    level, why = selected_level({}, {"sse4_2", "avx"}, "x86_64")
    assert level is None and why == "this CPU lacks avx2, fma, f16c (the kernels' lowest level is avx2)"


def test_this_machine_reads_its_own_flags():
    level, why = selected_level({})
    assert level is not None, why  # every CPU this project is tested on has AVX2 or is not x86
