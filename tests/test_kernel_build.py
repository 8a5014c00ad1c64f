"""Which kernel build loads (`sage_infer.hal.kernel_build`), and the first-use compile: it says so before it
starts, never hangs on a lock left by an interrupted build, and processes that start together compile once.

The compile tests build a tiny extension (a C-API module, ~1 s) through the same `jit_build` the kernels use,
each in a fresh process with a deadline, so a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from sage_infer.errors import ConfigError
from sage_infer.hal import kernel_build
from sage_infer.hal.isa import selected_level
from sage_infer.layers import cpu_kernels
from tests.conftest import runnable_cpu_levels

TINY = """\
#include <Python.h>
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define STR_(x) #x
#define STR(x) STR_(x)
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""
NO_COMPILER = kernel_build.compiler() is None
needs_compiler = pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler (c++ / g++) on PATH")


@pytest.mark.skipif(cpu_kernels.kernel_unavailable() is not None, reason=f"{cpu_kernels.kernel_unavailable()}")
def test_the_kernels_in_use_are_the_build_of_this_cpus_level():
    level, _ = selected_level({})
    assert cpu_kernels.kernel_level().startswith(f"{level} (the highest level this CPU has; ")
    assert cpu_kernels._module().isa() == level
    assert cpu_kernels._module().build_key() == kernel_build.build_key(level)


@pytest.mark.parametrize("level", runnable_cpu_levels())
def test_each_level_this_cpu_runs_loads_the_build_compiled_for_it(level, monkeypatch):
    monkeypatch.setenv("SAGE_CPU_ISA", level)
    assert cpu_kernels.kernel_unavailable() is None
    assert cpu_kernels._module().isa() == level
    assert cpu_kernels.kernel_level().startswith(f"{level} (forced by SAGE_CPU_ISA; ")
    # what each level can run is the level's, not the CPU's
    assert (cpu_kernels.small_linear_unavailable() is None) == (level == "avx512_bf16")
    assert cpu_kernels.flash_unavailable(64, cpu_kernels.torch.float32) is None
    assert (cpu_kernels.flash_unavailable(64, cpu_kernels.torch.bfloat16) is None) == (level != "avx512")


def test_a_forced_level_above_the_cpu_makes_the_kernels_unavailable_with_the_reason(monkeypatch):
    levels = ("avx2", "avx512", "avx512_bf16")
    top, _ = selected_level({})
    if top not in levels or top == levels[-1]:
        pytest.skip(f"this CPU runs the top level ({top}): nothing above it to force")
    above = levels[levels.index(top) + 1]
    monkeypatch.setenv("SAGE_CPU_ISA", above)
    assert cpu_kernels.kernel_unavailable().startswith(f"SAGE_CPU_ISA={above}: this CPU lacks ")


def build_script(cache: Path, name: str) -> str:
    return textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from sage_infer.hal.kernel_build import jit_build
        source = Path({str(cache)!r}) / "tiny.cpp"
        module = jit_build(Path({str(cache)!r}) / "build", {name!r}, (source,), [], "the tiny test module")
        print("loaded", module.__name__)
    """)


def run_build(cache: Path, name: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", build_script(cache, name)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parents[1])


@pytest.fixture
def cache(tmp_path) -> Path:
    (tmp_path / "tiny.cpp").write_text(TINY)
    return tmp_path


@needs_compiler
def test_a_first_use_compile_says_so_before_it_starts_and_the_next_start_loads_it(cache):
    first = run_build(cache, "sage_tiny_a")
    assert first.returncode == 0, first.stderr
    assert "sage: compiling the tiny test module once" in first.stderr and "loaded sage_tiny_a" in first.stdout
    second = run_build(cache, "sage_tiny_a")
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr and "loaded sage_tiny_a" in second.stdout


@needs_compiler
def test_a_lock_left_by_an_interrupted_build_does_not_hang_the_next_start(cache):
    build = cache / "build"
    build.mkdir()
    (build / "lock").write_text("")  # torch's baton, as a build killed mid-compile leaves it: it waits on it forever
    done = run_build(cache, "sage_tiny_b", timeout=240)  # subprocess.TimeoutExpired if it hangs
    assert done.returncode == 0, done.stderr
    assert "left by a kernel build that was interrupted" in done.stderr
    assert not (build / "lock").exists()


@needs_compiler
def test_a_process_killed_while_holding_the_build_lock_does_not_block_the_next(cache):
    build = cache / "build"
    build.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        handle = open({str(build / "sage.lock")!r}, "a+")
        fcntl.flock(handle, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-c", build_script(cache, "sage_tiny_c")], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        guard = threading.Timer(240, waiter.kill)  # a waiter that never says it waits must not block the suite
        guard.start()
        seen = []
        for line in waiter.stderr:
            seen.append(line)
            if "waiting for another process" in line:
                break
        guard.cancel()
        os.kill(holder.pid, signal.SIGKILL)  # the builder dies: the kernel drops its flock
        out, err = waiter.communicate(timeout=240)
        assert waiter.returncode == 0, "".join(seen) + err
        assert "waiting for another process that is compiling the tiny test module" in seen[-1]
        assert "loaded sage_tiny_c" in out
    finally:
        holder.kill()
        holder.wait()


@needs_compiler
def test_processes_that_start_together_compile_once(cache):
    script = build_script(cache, "sage_tiny_d")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1]) for _ in range(3)]
    results = [(p.communicate(timeout=240), p.returncode) for p in procs]
    assert all(code == 0 and "loaded sage_tiny_d" in out for (out, _), code in results), results
    compiled = sum("sage: compiling the tiny test module once" in err for (_, err), _ in results)
    assert compiled == 1
    # ninja's log: the object was compiled once, by the first process (the others found it up to date)
    objects = [line for line in (cache / "build" / ".ninja_log").read_text().splitlines()
               if line.split("\t")[3:4] == ["tiny.o"]]
    assert len(objects) == 1


@pytest.mark.parametrize("value", ["amx", "sse2"])
def test_a_sage_cpu_isa_that_is_no_level_is_one_line_and_exit_2(sage, monkeypatch, value):
    monkeypatch.setenv("SAGE_CPU_ISA", value)
    result = sage("llm", "generate", "--prompt", "ROMEO:")
    assert result.code == 2
    assert result.err.strip().splitlines() == [result.err.strip()]  # before any start-up line
    assert result.err.startswith(f"sage: error: SAGE_CPU_ISA={value}: not a level of this machine's kernels; one of ")


@needs_compiler
def test_the_install_builds_every_level_the_compiler_takes_never_march_native():
    from sage_infer.hal.isa import build_levels

    extensions = kernel_build.extensions()
    levels = [e.name.rsplit("_cpu_kernels_", 1)[1] for e in extensions]
    assert levels == [lv for lv in build_levels() if kernel_build.compiler_accepts(kernel_build.level_flags(lv))]
    for extension in extensions:
        assert not any("march" in flag for flag in extension.extra_compile_args)
        level = extension.name.rsplit("_cpu_kernels_", 1)[1]
        assert f"-DSAGE_BUILD_KEY={kernel_build.build_key(level)}" in extension.extra_compile_args


def test_kernel_levels_cpu_builds_the_levels_this_cpu_runs_and_all_builds_every_level():
    from sage_infer.hal.isa import build_levels

    assert kernel_build.install_levels({kernel_build.LEVELS_ENV: "cpu"}) == tuple(runnable_cpu_levels())
    assert kernel_build.install_levels({kernel_build.LEVELS_ENV: "all"}) == build_levels()
    assert kernel_build.install_levels({}) == build_levels()
    with pytest.raises(ConfigError, match="SAGE_KERNEL_LEVELS=native: expected all or cpu"):
        kernel_build.install_levels({kernel_build.LEVELS_ENV: "native"})


def test_an_installed_build_for_other_sources_is_not_loaded(monkeypatch):
    level, _ = selected_level({})
    if level is None or installed_build(level) is None:
        pytest.skip(f"no installed build of the {level} kernels here")
    compiled = []
    monkeypatch.setattr(kernel_build, "build_key", lambda lv: "kother0000000000")
    monkeypatch.setattr(kernel_build, "_compile_at_first_use", lambda lv, key: compiled.append((lv, key)) or
                        (None, "compile skipped by the test"))
    assert kernel_build.load(level) == (None, "compile skipped by the test")
    assert compiled == [(level, "kother0000000000")]


def installed_build(level: str):
    import importlib

    try:
        return importlib.import_module(f"sage_infer.layers.{kernel_build.module_name(level)}")
    except ImportError:
        return None


def test_first_use_compiles_go_under_sage_kernel_cache_when_set(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGE_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert kernel_build.cache_root() == tmp_path / "kernels"
    monkeypatch.delenv("SAGE_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_build.cache_root() == tmp_path / "xdg" / "sage_infer" / "kernels"


@needs_compiler
def test_a_failed_build_is_reported_by_the_compilers_error_not_ninjas_last_line(cache):
    (cache / "tiny.cpp").write_text("#include <no_such_header.h>\n" + TINY)
    failed = run_build(cache, "sage_tiny_broken")
    assert failed.returncode != 0
    assert "ninja: build stopped" in failed.stderr  # the output the reason is taken from
    reason = kernel_build.build_error(failed.stderr)
    assert "no_such_header.h" in reason and "error" in reason
    assert kernel_build.build_error("x\nninja: build stopped: subcommand failed.\n") == \
        "ninja: build stopped: subcommand failed."
