"""Resolve one `ServeConfig` from its layers and remember where each value came from.

Precedence, highest first: CLI flag > env ``SAGE_*`` > ``--config FILE`` > preset >
default. The hardware preset is named by ``--preset``, ``SAGE_PRESET``, the config
file's ``preset:`` (else ``auto``: detect this machine); the transport preset by
``--kv-transport preset=NAME``, ``SAGE_KV_TRANSPORT__PRESET`` or the config file's
``kv_transport.preset``. Preset values sit below every explicitly set value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource

from sage_infer.config.inactive import inactive_reason
from sage_infer.config.presets import deep_merge, load_hardware_preset, load_transport_preset
from sage_infer.config.serve import ServeConfig
from sage_infer.config.validation import format_validation_error
from sage_infer.config.yaml_source import load_yaml
from sage_infer.errors import ConfigError

LAYERS = ("default", "preset", "config", "env", "cli")
EXPLICIT_LAYERS = ("config", "env", "cli")  # what the user set, as opposed to defaults and presets


@dataclass(slots=True)
class ResolvedConfig:
    """The frozen config plus, per dotted field, the layer and origin that set it."""

    config: ServeConfig
    sources: dict[str, str]  # dotted field -> layer name (one of LAYERS)
    origins: dict[str, str]  # dotted field -> file:line, env var or flag
    hardware_preset: str
    transport_preset: str | None

    def rows(self) -> list[dict]:
        """One row per leaf value: field, value (secrets hidden), source, origin, and
        whether the serve process uses it (``active``; else ``inactive_reason`` says why)."""
        rows = []
        for dotted, value in _leaves(self.config.model_dump(mode="json")):
            if dotted.startswith("hardware.sources."):
                continue
            if dotted == "api_key" and value is not None:
                value = "**********"
            layer = _lookup(self.sources, dotted) or "default"
            reason = inactive_reason(dotted, self.config)
            rows.append({
                "field": dotted, "value": value, "source": layer, "origin": _lookup(self.origins, dotted) or "",
                "active": reason is None, "inactive_reason": reason,
            })
        return rows

    def explicit_inactive_fields(self) -> list[str]:
        """Inactive fields the user set (flag, env var or config file), for the start-up warning."""
        return [r["field"] for r in self.rows() if not r["active"] and r["source"] in EXPLICIT_LAYERS]


@dataclass(slots=True)
class _Layers:
    values: dict = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def add(self, layer: str, values: dict, origin_of) -> None:
        self.values = deep_merge(self.values, values)
        for dotted, _ in _leaves(values):
            self.sources[dotted] = layer
            self.origins[dotted] = origin_of(dotted)


def resolve_config(
    *,
    preset: str | None = None,
    config_file: str | Path | None = None,
    cli: dict | None = None,
    cli_origins: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> ResolvedConfig:
    """Build the `ServeConfig` for this process.

    `cli` holds CLI overrides as a nested dict (``{"kv_pool": {"block_size": 32}}``);
    `cli_origins` names the flag behind each dotted field for error messages. `env`
    defaults to ``os.environ``; when given, only that dict is read (the process env is
    not). Any invalid value raises `ConfigError` naming its origin.
    """
    cli = dict(cli or {})
    cli_origins = cli_origins or {}
    env_values = _env_layer(os.environ if env is None else env)

    config_values: dict = {}
    config_doc = None
    if config_file is not None:
        config_doc = load_yaml(config_file)
        config_values = config_doc.data

    if preset is not None:
        cli["preset"] = preset
        cli_origins.setdefault("preset", "--preset")
    hardware_name = _first(cli.get("preset"), env_values.get("preset"), config_values.get("preset")) or "auto"
    transport_name = _first(
        cli.get("kv_transport", {}).get("preset"),
        env_values.get("kv_transport", {}).get("preset"),
        config_values.get("kv_transport", {}).get("preset") if isinstance(config_values.get("kv_transport"), dict)
        else None,
    )

    layers = _Layers()
    relative_to = config_doc.path.parent if config_doc else None
    preset_name = detect_preset_name() if hardware_name == "auto" else hardware_name
    try:
        hardware = load_hardware_preset(preset_name, relative_to=relative_to)
    except ConfigError as err:
        if str(err).startswith("unknown"):  # name the flag/env/file line that asked for it
            raise ConfigError(f"{_origin_of_preset(cli_origins, env_values, config_doc)}: {err}") from None
        raise
    layers.add("preset", {"hardware": hardware.profile.model_dump(mode="json")},
               lambda d: hardware.source.where(d.removeprefix("hardware.")))
    if transport_name:
        transport = load_transport_preset(str(transport_name), relative_to=relative_to)
        layers.add("preset", {"kv_transport": transport.preset.values()},
                   transport.source.where)
    if config_doc is not None:
        layers.add("config", config_values, config_doc.where)
    layers.add("env", env_values, lambda d: "env SAGE_" + d.replace(".", "__").upper())
    layers.add("cli", cli, lambda d: _lookup(cli_origins, d) or "command line")
    if hardware_name == "auto":
        layers.values["preset"] = "auto"

    try:
        config = ServeConfig.model_validate(layers.values)
    except ValidationError as err:
        where = lambda d: _lookup(layers.origins, d) or "config"  # noqa: E731
        raise ConfigError(format_validation_error(err, where, ServeConfig)) from None
    return ResolvedConfig(
        config=config,
        sources=layers.sources,
        origins=layers.origins,
        hardware_preset=preset_name,
        transport_preset=str(transport_name) if transport_name else None,
    )


def detect_preset_name() -> str:
    """The shipped preset matching this machine's accelerators (``cpu`` when none)."""
    from sage_infer.config.recommend import match_preset
    from sage_infer.hal.detect import detect_devices

    return match_preset(detect_devices(measure=False))


def _env_layer(environ: dict[str, str]) -> dict:
    source = EnvSettingsSource(ServeConfig)
    source.env_vars = {k.lower(): v for k, v in environ.items()}
    values = source()
    # pydantic-settings hands nested models back as dicts but JSON-decodes nothing else
    return {k: v for k, v in values.items() if v is not None}


def _origin_of_preset(cli_origins: dict[str, str], env_values: dict, config_doc) -> str:
    if "preset" in cli_origins:
        return cli_origins["preset"]
    if "preset" in env_values:
        return "env SAGE_PRESET"
    if config_doc is not None and "preset" in config_doc.data:
        return config_doc.where("preset")
    return "preset"


def _first(*values):
    for value in values:
        if value is not None:
            return value
    return None


def _lookup(table: dict[str, str], dotted: str) -> str | None:
    parts = dotted.split(".")
    while parts:
        hit = table.get(".".join(parts))
        if hit:
            return hit
        parts.pop()
    return None


def _leaves(tree: object, prefix: str = ""):
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, tree
