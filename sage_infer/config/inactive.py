"""The one list of config fields the serve process validates but does not use yet.

`sage config show` marks these rows INACTIVE with the reason, and `sage llm serve` /
`sage llm generate` warn once at start-up when the user set one explicitly. When a
later issue builds the feature, it deletes its entry here and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterable

# dotted prefix -> why nothing reads it. The longest matching prefix wins.
INACTIVE: dict[str, str] = {
    "kv_transport": "prefill/decode separation is not built yet, so no KV moves between instances; "
                    "values are validated but not used (sage transport bench/recommend take their own flags)",
    # The hardware preset drives the device (device.torch_device_type, device.python_module),
    # the KV dtype (kv.default_dtype, kv.dtypes), auto-detection (device.model_names), the
    # host tier's default size (memory.host_ddr_gb, device.devices_per_node) and the tiers'
    # cost model (device.dense_bf16_tflops, host_link, inter_node_nics, devices_per_node).
    # The rest describes the machine for `sage transport recommend/probe` and planning.
    "hardware.device.visible_devices_env": "informational: the serve process uses device 0 of the chosen type",
    "hardware.device.distributed_backend": "used by multi-device serving, which is not built yet",
    "hardware.memory.hbm_gb": "read by sage transport probe/recommend; pool sizing measures free memory instead",
    "hardware.memory.bandwidth_gb_s": "read by sage transport probe/recommend; not used by the serve process",
    "hardware.intra_node_link": "read by sage transport recommend; not used by the serve process",
    "hardware.probe_commands": "informational: commands to measure this machine by hand",
    "hardware.transport": "read by sage transport recommend; not used by the serve process",
    "hardware.description": "informational",
}


def inactive_reason(dotted: str) -> str | None:
    """Why `dotted` (e.g. ``tiers.host_bytes``) is not used, or None when it is."""
    parts = dotted.split(".")
    while parts:
        reason = INACTIVE.get(".".join(parts))
        if reason is not None:
            return reason
        parts.pop()
    return None


def section_of(dotted: str) -> str:
    """The registry entry `dotted` falls under (``kv_transport.backend`` -> ``kv_transport``)."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in INACTIVE:
            return ".".join(parts)
        parts.pop()
    return dotted


def inactive_warning(fields: Iterable[str]) -> str | None:
    """One warning line naming the explicitly set inactive fields, grouped by section."""
    by_section: dict[str, list[str]] = {}
    for dotted in fields:
        by_section.setdefault(section_of(dotted), []).append(dotted)
    if not by_section:
        return None
    parts = [f"{', '.join(names)} ({section}: {INACTIVE[section]})" for section, names in by_section.items()]
    return "sage: warning: set but INACTIVE, so ignored: " + "; ".join(parts)
