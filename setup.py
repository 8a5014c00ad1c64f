"""Compiles the CPU kernels at install, once per ISA level (sage_infer/hal/kernel_build.py); the rest of the
package metadata is in pyproject.toml.

The build needs torch importable: ``pip install --no-build-isolation .`` after torch (an isolated build
environment has no torch, and pip would fetch a CUDA one for it).
``SAGE_KERNEL_LEVELS=cpu`` builds only the levels this CPU can run (default ``all``: every x86-64 level).
``SAGE_BUILD_KERNELS=0`` builds none (`make install` then runs ``setup.py build_ext --inplace``, which
shows the compiler's progress and recompiles only what changed). Without torch or a C++ compiler here, the
package installs without kernels, says so in one line, and the kernels compile at first use (or the engine
takes the PyTorch path).
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernel_build() -> dict:
    if os.environ.get("SAGE_BUILD_KERNELS") == "0":  # `make install`: built in place by its own step
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        print("sage-infer: torch is not importable in the build environment: no prebuilt CPU kernels (they compile "
              "at first use; `pip install --no-build-isolation .` after torch builds them now)", file=sys.stderr)
        return {}
    from sage_infer.hal import kernel_build as kb

    if kb.compiler() is None:
        print("sage-infer: no C++ compiler (c++ / g++): no CPU kernels; the engine takes the PyTorch path",
              file=sys.stderr)
        return {}
    if shutil.which("ninja") is None:
        kb._put_ninja_on_path()
    from sage_infer.errors import ConfigError

    try:
        ext_modules = kb.extensions()
    except ConfigError as err:  # one line, exit 2, as for any bad setting
        print(f"sage-infer: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return {"ext_modules": ext_modules, "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)}}


setup(**kernel_build())
