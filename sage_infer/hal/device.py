"""Turn a hardware preset's device type into a usable `torch.device`, or say in one
line why this machine cannot provide it.

Vendor plugins (torch_npu, torch_mlu, ...) register their device type with torch when
imported, so they are imported here, lazily, only when a preset asks for their device;
``import sage_infer`` never imports them. hal sits below config: this module takes
plain strings (device type, plugin module, who asked) rather than a preset object.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from sage_infer.errors import ConfigError
from sage_infer.hal.isa import read_cpu_flags


class DeviceNotAvailableError(ConfigError):
    """The configuration asks for a device this machine (or this torch build) lacks.

    A `ConfigError` (exit 2): the fix is a different preset or ``--device``, not a retry.
    """


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """One torch device type: the plugin that registers it and what to call it in errors."""

    plugin: str | None  # module to import before torch knows the type; None: built into torch
    label: str


# Hygon DCU runs a ROCm (HIP) build of torch, which exposes the DCU as torch's "cuda"
# device; Kunlunxin's CUDA-compatible torch build does the same. Their presets say
# ``torch_device_type: cuda`` and name their plugin in ``python_module``.
DEVICE_KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind(None, "CPU"),
    "cuda": DeviceKind(None, "CUDA/ROCm GPU"),
    "npu": DeviceKind("torch_npu", "Ascend NPU"),
    "mlu": DeviceKind("torch_mlu", "Cambricon MLU"),
    "xpu": DeviceKind(None, "XPU"),
}

# What to call a vendor's device in an error line (vendor strings as presets spell them).
VENDOR_LABELS: dict[str, str] = {
    "nvidia": "NVIDIA GPU",
    "hygon": "Hygon DCU via ROCm",
    "ascend": "Ascend NPU",
    "cambricon": "Cambricon MLU",
    "kunlunxin": "Kunlunxin XPU",
}

# Modules that are torch itself (a preset's python_module may name them): nothing to import.
_BUILT_IN = {"torch", "torch.cuda", "torch.xpu"}


def select_device(
    device_type: str, plugin: str | None = None, *, requested_by: str = "the configuration", vendor: str | None = None
) -> torch.device:
    """The torch device of type `device_type` (cpu, cuda, npu, mlu, xpu), index 0.

    `plugin` overrides the module imported first (a preset's ``device.python_module``);
    `requested_by` names who asked (``"preset ascend-910b"``) and `vendor` the hardware
    in the error line. Raises
    `DeviceNotAvailableError` when the plugin is missing or no such device is present.
    """
    kind = DEVICE_KINDS.get(device_type)
    if kind is None:
        raise DeviceNotAvailableError(
            f"{requested_by} asks for torch device type {device_type!r}, which sage_infer does not know "
            f"(known: {', '.join(DEVICE_KINDS)})"
        )
    if device_type == "cpu":
        return torch.device("cpu")
    label = VENDOR_LABELS.get(vendor or "", kind.label)
    module = plugin if plugin not in (None, *_BUILT_IN) else kind.plugin
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError:
            raise DeviceNotAvailableError(f"{requested_by} needs {module} ({label}): not installed") from None
        except Exception as err:  # noqa: BLE001 - a broken vendor install is still one line
            raise DeviceNotAvailableError(
                f"{requested_by} needs {module} ({label}): import failed: {type(err).__name__}: {err}"
            ) from None
    backend = getattr(torch, device_type, None)
    count = _device_count(backend)
    if count == 0:
        raise DeviceNotAvailableError(f"{requested_by} needs torch device {device_type!r} ({label}): "
                                      f"{_why_none(device_type, module)}")
    return torch.device(device_type, 0)


def _device_count(backend) -> int:
    try:
        if backend is None or not backend.is_available():
            return 0
        return int(backend.device_count())
    except Exception:  # noqa: BLE001 - a driver error means: no usable device
        return 0


def _why_none(device_type: str, module: str | None) -> str:
    if device_type == "cuda" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "this torch build has no CUDA or ROCm support"
    if module is not None:
        return f"{module} is installed but sees no device"
    return "none is visible to torch"


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of an accelerator (``mem_get_info`` of its torch module); None for the
    CPU, whose KV lives in host memory (see `hal.cpu.read_mem_available`)."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    mem_get_info = getattr(backend, "mem_get_info", None)
    if mem_get_info is None:
        return None
    return int(mem_get_info(device)[0])


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What the KV dtype choice needs to know about the chosen device."""

    type: str
    native_bf16: bool  # computes on bf16 directly (GPU/NPU with bf16 units, CPU with AVX512-BF16/AMX)
    bf16_note: str  # why, for the startup line


def device_facts(device: torch.device) -> DeviceFacts:
    """Probe `device` for bf16 support (cheap: flags and capability queries, no kernels)."""
    if device.type == "cpu":
        flags = _cpu_flags()
        found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})  # x86 flags; "bf16" on arm64
        if found:
            return DeviceFacts("cpu", True, f"CPU has {', '.join(found)}")
        return DeviceFacts("cpu", False, "CPU has no AVX512-BF16/AMX-BF16 (bf16 would be emulated)")
    if device.type == "cuda":
        try:
            supported = bool(torch.cuda.is_bf16_supported())
        except Exception:  # noqa: BLE001
            supported = False
        return DeviceFacts("cuda", supported, "GPU supports bf16" if supported else "GPU lacks bf16 (pre-Ampere)")
    # NPU/MLU/XPU parts the shipped presets name all compute in bf16
    return DeviceFacts(device.type, True, f"{device.type} device computes in bf16")


def _cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    return read_cpu_flags(Path(path)) or set()
