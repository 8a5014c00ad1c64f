"""Building and loading the C++ CPU kernels (sage_infer/layers/csrc/), one build per ISA level (`sage_infer.hal.isa`).

Here in hal, below every user of the kernels: the layers' kernels (`sage_infer.layers.cpu_kernels`) and the KV
codec of the pool and the transport (`sage_infer.quantization.kv_codec_kernel`) load the same build.

The install builds them (setup.py calls `extensions()`; `make install` shows the compiler's progress), as
``sage_infer/layers/_cpu_kernels_<level>``, each compiled with that level's flags (never
``-march=native``), so one install runs on any x86-64 CPU and loads the highest build the CPU can run.
``SAGE_KERNEL_LEVELS=cpu`` (``make install KERNEL_LEVELS=cpu``) builds only the levels this CPU can run.

Each build carries a key (`build_key`: a hash of the sources, headers, flags, torch and Python versions and
the level). A build whose key differs from the sources on disk (the C++ was edited after the install, or torch
was upgraded) is not loaded; nor is a missing one. Then the kernels are compiled once at first use
(`torch.utils.cpp_extension.load`), in a directory named by the key under ``SAGE_KERNEL_CACHE`` (default
``~/.cache/sage_infer/kernels``), after one line on stderr that says so. Processes that start together take
an ``flock`` on that directory, so one compiles and the others wait for it and load its result; the lock dies
with its process, so an interrupted build never leaves a start hanging (torch's own lock file, which a killed
build leaves behind, is removed with a warning by the next process that holds the flock).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

from sage_infer.errors import ConfigError
from sage_infer.hal.isa import ENV, build_levels, compile_flags, selected_level

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parents[1] / "layers" / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_decode.cpp", "fused_ops.cpp", "small_linear.cpp", "flash_bf16.cpp",
                                         "flash_avx2.cpp", "decode_step.cpp", "bf16_rows.cpp", "kv_codec.cpp",
                                         "moe_experts.cpp"))
HEADERS = tuple(CSRC / name for name in ("kernel.h", "widen.h", "vec_exp.h", "flash.h", "ieee_div.h"))
# -g0: Python's CFLAGS ask for debug info, which doubles the compile time; -ffast-math: the dot products
# and exp vectorize only with reassociation allowed; hidden visibility keeps one level's symbols from
# resolving another's when two builds are loaded in one process (tests force levels); gcc's own AVX-512 intrinsic
# headers declare `__m512 __Y = __Y;`, which -Wall (from Python's CFLAGS) reports hundreds of times
BASE_FLAGS = ("-O3", "-g0", "-ffast-math", "-fopenmp", "-fvisibility=hidden", "-Wno-uninitialized",
              "-Wno-maybe-uninitialized")
LINK_FLAGS = ("-fopenmp",)
# what a first-use compile of one level takes (9 files, 2 cores): printed before it starts
COMPILE_SECONDS = "about 1-2 minutes on 2 cores"
CACHE_ENV = "SAGE_KERNEL_CACHE"
LEVELS_ENV = "SAGE_KERNEL_LEVELS"


def module_name(level: str) -> str:
    return f"_cpu_kernels_{level}"


def level_flags(level: str) -> list[str]:
    return [*BASE_FLAGS, *compile_flags(level)]


def build_key(level: str) -> str:
    """16 hex digits naming one build: the sources and headers, the flags, torch's and Python's versions."""
    import torch

    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join([level, *level_flags(level), *LINK_FLAGS, torch.__version__,
                            f"py{sys.version_info[0]}.{sys.version_info[1]}"]).encode())
    return "k" + digest.hexdigest()[:15]  # an identifier: it also goes into the JIT module's name


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def compiler_accepts(flags: list[str], cxx: str | None = None) -> bool:
    """Whether the C++ compiler takes `flags` (an older gcc may not know -mavx512bf16)."""
    cxx = cxx or compiler()
    if cxx is None:
        return False
    try:
        done = subprocess.run([cxx, *flags, "-x", "c++", "-fsyntax-only", "-"], input=b"int main() { return 0; }\n",
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def install_levels(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The levels the install builds: every level (``SAGE_KERNEL_LEVELS`` unset or ``all``: the install can move to
    another x86-64 CPU, a container image for one), or ``cpu``: those this CPU can run (the levels above it compile
    at first use should the install move to a CPU that has them). ConfigError for another value."""
    env = os.environ if env is None else env
    choice = env.get(LEVELS_ENV, "all").strip().lower() or "all"
    levels = build_levels()
    if choice == "all":
        return levels
    if choice != "cpu":
        raise ConfigError(f"{LEVELS_ENV}={choice}: expected all or cpu")
    top, _ = selected_level({})
    return () if top is None else levels[: levels.index(top) + 1]


def extensions() -> list:
    """The `CppExtension`s of the install's levels (`install_levels`) the compiler can build here, for setup.py."""
    from torch.utils.cpp_extension import CppExtension

    root = Path(__file__).resolve().parents[2]
    result = []
    for level in install_levels():
        flags = level_flags(level)
        if not compiler_accepts(flags):
            print(f"sage-infer: the compiler does not take {' '.join(compile_flags(level))}: no {level} build "
                  f"of the CPU kernels (CPUs with {level} run the next level down)", file=sys.stderr)
            continue
        result.append(CppExtension(
            name=f"sage_infer.layers.{module_name(level)}",
            sources=[str(p.relative_to(root)) for p in SOURCES],
            extra_compile_args=[*flags, f"-DSAGE_BUILD_KEY={build_key(level)}", f"-DSAGE_ISA_LEVEL={level}"],
            extra_link_args=list(LINK_FLAGS),
        ))
    return result


def load(level: str) -> tuple[ModuleType | None, str]:
    """The kernels built for `level`: (module, how it was found) or (None, why not). The install's build
    when its key matches the sources here, else a build compiled at first use (see the module docstring)."""
    key = build_key(level)
    try:
        module = importlib.import_module(f"sage_infer.layers.{module_name(level)}")
    except ImportError as err:
        module, stale = None, f"the install built no {level} kernels ({err})"
    else:
        if module.build_key() == key:
            return module, "built by the install"
        module, stale = None, f"the installed {level} build is for other sources or another torch"
    log.info("%s", stale)
    return _compile_at_first_use(level, key)


@cache
def load_selected(forced: str) -> tuple[ModuleType | None, str | None, str]:
    """(module, why it is unavailable, how it was chosen and found) for ``SAGE_CPU_ISA=forced`` ('' unset); keyed
    by the variable's raw value, so each kernel call costs one environment read (`selected_level` normalizes)."""
    try:
        level, why_level = selected_level({ENV: forced} if forced else {})
    except ConfigError as err:
        return None, str(err), ""
    if level is None:
        return None, why_level, ""
    module, how = load(level)
    if module is None:
        return None, how, ""
    return module, None, f"{level} ({why_level}; {how})"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sage_infer" / "kernels"


def _compile_at_first_use(level: str, key: str) -> tuple[ModuleType | None, str]:
    if compiler() is None:
        return None, "no C++ compiler (c++ / g++) on PATH, and the install built no kernels"
    if shutil.which("ninja") is None and not _put_ninja_on_path():
        return None, "ninja is not installed (torch.utils.cpp_extension builds with it)"
    directory = cache_root() / f"{level}-{key}"
    try:
        module = jit_build(directory, f"sage_cpu_kernels_{level}_{key}", SOURCES,
                           [*level_flags(level), f"-DSAGE_BUILD_KEY={key}", f"-DSAGE_ISA_LEVEL={level}"],
                           f"the CPU kernels for {level}")
    except Exception as err:  # a compiler error, a missing header: the PyTorch path still works
        return None, f"building the CPU kernels failed: {build_error(str(err)) or repr(err)}"
    return module, f"compiled at first use in {directory}"


def build_error(text: str) -> str:
    """The line of a failed build's output that says why: the compiler's first error (ninja's own last line only
    says that a command failed), else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror:", line, re.IGNORECASE):  # (not "CalledProcessError:" of a traceback)
            return line
    return lines[-1] if lines else ""


def jit_build(directory: Path, name: str, sources: tuple[Path, ...], cflags: list[str], what: str) -> ModuleType:
    """`torch.utils.cpp_extension.load` of `sources` as module `name` in `directory`, under an flock there:
    one process compiles (after a line on stderr), the others wait and load its result."""
    from torch.utils.cpp_extension import load as torch_load

    directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(directory / "sage.lock", what):
        if not (directory / f"{name}.so").exists():
            print(f"sage: compiling {what} once ({COMPILE_SECONDS}; `make install` builds them ahead); later "
                  f"starts load them from {directory}", file=sys.stderr, flush=True)
        leftover = directory / "lock"  # torch's baton: held by no one while we hold the flock
        if leftover.exists():
            log.warning("removing %s, left by a kernel build that was interrupted", leftover)
            leftover.unlink(missing_ok=True)
        start = time.perf_counter()
        module = torch_load(name=name, sources=[str(p) for p in sources], build_directory=str(directory),
                            extra_cflags=cflags, extra_ldflags=list(LINK_FLAGS), verbose=False)
        log.info("%s loaded from %s in %.1f s", what, directory, time.perf_counter() - start)
    return module


@contextmanager
def _exclusive(path: Path, what: str):
    """An exclusive flock on `path`: one process builds at a time; the kernel drops it if the process dies."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"sage: waiting for another process that is compiling {what} ({path.parent})",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _put_ninja_on_path() -> bool:
    """The `ninja` package's binary on PATH (torch runs ``ninja`` by name; a venv's bin is not on PATH unless
    activated). False when the package is not installed either."""
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return shutil.which("ninja") is not None
