"""The one list of config fields the serve process validates but does not use yet.

`sage config show` marks these rows INACTIVE with the reason, and `sage llm serve` /
`sage llm generate` warn once at start-up when the user set one explicitly. When a
later issue builds the feature, it deletes its entry here and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sage_infer.config.serve import ServeConfig

# dotted prefix -> why nothing reads it. The longest matching prefix wins.
INACTIVE: dict[str, str] = {
    # the other kv_transport fields drive the KV pipe of a prefill or decode instance (CONDITIONAL below)
    "kv_transport.preset": "informational: the transport preset the kv_transport values started from",
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


# dotted prefix -> (is it used under this config?, why not when it is not)
CONDITIONAL: dict[str, tuple[Callable[[ServeConfig], bool], str]] = {
    "router": (lambda config: config.pd is not None,
               "used only by the router of a local prefill/decode deployment (--pd xPyD)"),
    "kv_transport": (lambda config: config.role != "both" or config.pd is not None,
                     "used only by a prefill or decode instance (--role prefill|decode, or --pd); "
                     "this one serves both roles, so no KV moves between instances"),
    "scheduler.long_prefill_token_threshold": (lambda config: config.scheduler.enable_chunked_prefill,
                                               "used only with scheduler.enable_chunked_prefill (without it a "
                                               "prompt is never cut)"),
    "scheduler.short_prefill_first": (
        lambda config: config.scheduler.enable_chunked_prefill and config.scheduler.long_prefill_token_threshold > 0,
        "used only with scheduler.enable_chunked_prefill and a scheduler.long_prefill_token_threshold (the length "
        "that makes a prompt short)"),
    **{f"kv_events.{name}": (lambda config: config.kv_events.publisher == "zmq",
                             "used only with kv_events.publisher=zmq")
       for name in ("endpoint", "replay_endpoint", "buffer_steps", "topic")},
    "kv_pool.layer_loads": (
        lambda config: bool(config.tiers.host_bytes or config.tiers.disk_path or config.tiers.remote_url)
        or config.role != "both" or config.pd is not None,
        "used only where KV is loaded at admission: a lower KV tier (tiers.*) or a decode instance's received "
        "transfers (--role decode, --pd)"),
    "kv_transport.process_group": (lambda config: config.kv_transport.backend == "torchdist",
                                   "used only with kv_transport.backend=torchdist (the group its KV moves in)"),
    **{f"kv_transport.process_group.{name}": (
        lambda config: config.kv_transport.backend == "torchdist" and config.pd is None,
        "used by a torchdist worker started on its own (--role); --pd gives each worker its rank and the world size")
       for name in ("rank", "world_size")},
}


def inactive_reason(dotted: str, config: ServeConfig | None = None) -> str | None:
    """Why `dotted` (e.g. ``tiers.host_bytes``) is not used under `config`, or None when it is.

    Without a config, fields that only some configs use count as used."""
    parts = dotted.split(".")
    while parts:
        prefix = ".".join(parts)
        reason = INACTIVE.get(prefix)
        if reason is not None:
            return reason
        rule = CONDITIONAL.get(prefix)
        if rule is not None and config is not None and not rule[0](config):
            return rule[1]
        parts.pop()
    return None


def section_of(dotted: str) -> str:
    """The registry entry `dotted` falls under (``kv_transport.preset`` -> itself,
    ``kv_transport.backend`` -> ``kv_transport``)."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in INACTIVE or ".".join(parts) in CONDITIONAL:
            return ".".join(parts)
        parts.pop()
    return dotted


def inactive_warning(fields: Iterable[str], config: ServeConfig | None = None) -> str | None:
    """One warning line naming the explicitly set inactive fields, grouped by section."""
    by_section: dict[str, list[str]] = {}
    for dotted in fields:
        by_section.setdefault(section_of(dotted), []).append(dotted)
    if not by_section:
        return None
    parts = [f"{', '.join(names)} ({section}: {inactive_reason(names[0], config)})"
             for section, names in by_section.items()]
    return "sage: warning: set but INACTIVE, so ignored: " + "; ".join(parts)
