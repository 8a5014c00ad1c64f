"""Find, load and validate hardware and transport presets.

Shipped presets live in ``sage_infer/presets/{hardware,transport}/NAME.yaml`` (the
repository's top-level ``presets/`` points there). A name or a path to a YAML file
is accepted anywhere a preset is. A preset may start from another one with
``extends: NAME`` (or a relative path): mappings merge key by key, lists and scalars
are replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from sage_infer.config.hardware import HardwareProfile, has_path
from sage_infer.config.transport import TransportPreset
from sage_infer.config.validation import format_validation_error
from sage_infer.config.yaml_source import load_yaml
from sage_infer.errors import ConfigError

PresetKind = Literal["hardware", "transport"]
_MAX_EXTENDS_DEPTH = 8


def presets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "presets"


def list_presets(kind: PresetKind) -> list[str]:
    return sorted(p.stem for p in (presets_dir() / kind).glob("*.yaml"))


@dataclass(slots=True)
class PresetSource:
    """Merged preset data plus, per dotted field, the ``file:line`` that set it."""

    path: Path
    data: dict
    origins: dict[str, str] = field(default_factory=dict)
    chain: list[str] = field(default_factory=list)  # files, most derived first

    def where(self, dotted: str) -> str:
        parts = dotted.split(".")
        while parts:
            origin = self.origins.get(".".join(parts))
            if origin:
                return origin
            parts.pop()
        return str(self.path)


@dataclass(slots=True)
class LoadedHardwarePreset:
    profile: HardwareProfile
    source: PresetSource


@dataclass(slots=True)
class LoadedTransportPreset:
    preset: TransportPreset
    source: PresetSource


def resolve_preset_path(kind: PresetKind, name_or_path: str, relative_to: Path | None = None) -> Path:
    """A shipped preset name, or a path to a YAML file (relative to `relative_to` if given)."""
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    if looks_like_path:
        candidate = Path(name_or_path).expanduser()
        if not candidate.is_absolute() and relative_to is not None:
            candidate = relative_to / candidate
        return candidate
    shipped = presets_dir() / kind / f"{name_or_path}.yaml"
    if not shipped.exists():
        known = ", ".join(list_presets(kind))
        raise ConfigError(f"unknown {kind} preset {name_or_path!r}; expected one of: {known} or a .yaml path")
    return shipped


def load_preset_source(kind: PresetKind, name_or_path: str, relative_to: Path | None = None) -> PresetSource:
    """Read a preset file and everything it extends, merged, with per-field origins."""
    chain: list[Path] = []
    path = resolve_preset_path(kind, name_or_path, relative_to)
    docs = []
    while True:
        resolved = path.resolve()
        if resolved in chain:
            cycle = " -> ".join(str(p) for p in [*chain, resolved])
            raise ConfigError(f"{path}: extends forms a cycle: {cycle}")
        if len(chain) >= _MAX_EXTENDS_DEPTH:
            raise ConfigError(f"{path}: extends is nested more than {_MAX_EXTENDS_DEPTH} levels deep")
        chain.append(resolved)
        doc = load_yaml(path)
        docs.append(doc)
        parent = doc.data.get("extends")
        if parent is None:
            break
        if not isinstance(parent, str) or not parent:
            raise ConfigError(f"{doc.where('extends')}: extends: expected a preset name or path, got {parent!r}")
        try:
            path = resolve_preset_path(kind, parent, relative_to=path.parent)
        except ConfigError as err:
            raise ConfigError(f"{doc.where('extends')}: extends: {err}") from None

    merged: dict = {}
    origins: dict[str, str] = {}
    for doc in reversed(docs):  # base first, most derived last
        data = {k: v for k, v in doc.data.items() if k != "extends"}
        merged = deep_merge(merged, data)
        for dotted, line in doc.lines.items():
            if dotted != "extends":
                origins[dotted] = f"{doc.path}:{line}"
    if len(docs) > 1:
        _drop_stale_sources(merged, origins, [str(d.path) for d in docs])
        merged["name"] = docs[0].data.get("name", docs[0].path.stem)
        if "name" not in docs[0].data:
            origins["name"] = str(docs[0].path)
    return PresetSource(path=docs[0].path, data=merged, origins=origins, chain=[str(p) for p in chain])


def _drop_stale_sources(merged: dict, origins: dict[str, str], files: list[str]) -> None:
    """A value overridden by a derived preset no longer has its base's source: mark it."""
    sources = merged.get("sources")
    if not isinstance(sources, dict):
        return
    rank = {f: i for i, f in enumerate(files)}  # 0 = most derived
    for dotted in list(sources):
        value_file = origins.get(dotted, "").rsplit(":", 1)[0]
        source_file = origins.get(f"sources.{dotted}", "").rsplit(":", 1)[0]
        if not has_path(merged, dotted) and rank.get(source_file, 0) > 0:
            del sources[dotted]  # a derived preset replaced the list this item was in
            continue
        if value_file in rank and source_file in rank and rank[value_file] < rank[source_file]:
            sources[dotted] = {"confidence": "placeholder", "ref": f"overridden in {value_file} with no source given"}


def load_hardware_preset(name_or_path: str, relative_to: Path | None = None) -> LoadedHardwarePreset:
    source = load_preset_source("hardware", name_or_path, relative_to)
    try:
        profile = HardwareProfile.model_validate(source.data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source.where, HardwareProfile)) from err
    return LoadedHardwarePreset(profile=profile, source=source)


def load_transport_preset(name_or_path: str, relative_to: Path | None = None) -> LoadedTransportPreset:
    source = load_preset_source("transport", name_or_path, relative_to)
    try:
        preset = TransportPreset.model_validate(source.data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source.where, TransportPreset)) from err
    return LoadedTransportPreset(preset=preset, source=source)


def deep_merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`: mappings merge recursively, anything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
