"""Parse ``key=value`` flags into the nested dict the resolver takes as its CLI layer.

``--kv-transport preset=high-bw --kv-transport target-dtype=fp8_e4m3`` ->
``{"kv_transport": {"preset": "high-bw", "target_dtype": "fp8_e4m3"}}``. Values stay
strings; pydantic converts them and reports a bad one with the flag that set it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import BaseModel

from sage_infer.config.serve import ServeConfig
from sage_infer.config.transport import KVTransportConfig
from sage_infer.config.validation import is_secret
from sage_infer.errors import UsageError

KV_TRANSPORT_ALIASES = {
    "dtype": "target_dtype",
    "chunk": "chunk_size",
    "inflight": "max_inflight",
}


@dataclass(slots=True)
class CliLayer:
    """Nested overrides plus the flag text behind each dotted field."""

    values: dict = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def set(self, dotted: str, value: object, origin: str) -> None:
        node = self.values
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"{origin}: {'.'.join(parts[:-1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
        self.origins[dotted] = origin


def _split(flag: str, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"{flag} {item!r}: expected key=value")
    if value.strip() == "":
        raise UsageError(f"{flag} {item}: empty value for {key!r}")
    return key, value.strip()


def add_kv_transport_flags(layer: CliLayer, items: list[str] | None) -> None:
    """``--kv-transport key=value`` (dashes or underscores; a few short aliases); a field of a nested
    section as ``section.key=value`` (``process-group.rank=0``)."""
    for item in items or []:
        for part in item.split(","):  # also accept preset=high-bw,backend=shm
            key, value = _split("--kv-transport", part)
            names = key.replace("-", "_").lower().split(".")
            names[0] = KV_TRANSPORT_ALIASES.get(names[0], names[0])
            _check_field_path(KVTransportConfig, names, key)
            dotted = f"kv_transport.{'.'.join(names)}"
            layer.set(dotted, value, f"--kv-transport {key}={_shown(dotted, value)}")


def _check_field_path(model: type[BaseModel], names: list[str], key: str) -> None:
    """`names` leads through `model`'s sections to one value; else a UsageError saying what is there."""
    for depth, name in enumerate(names):
        fields = model.model_fields
        if name not in fields:
            where = f"in {'.'.join(names[:depth])} ".replace("_", "-") if depth else ""
            choices = ", ".join(sorted(k.replace("_", "-") for k in fields))
            raise UsageError(f"--kv-transport: unknown key {key!r}; expected {where}one of: {choices}")
        annotation = fields[name].annotation
        section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        last = depth == len(names) - 1
        if section and last:
            raise UsageError(f"--kv-transport {key}: {key} is a section; set {key}.KEY=VALUE")
        if not section and not last:
            raise UsageError(f"--kv-transport {key}: {'.'.join(names[: depth + 1])} is a value, not a section")
        model = annotation


def add_kv_tiers_flags(layer: CliLayer, items: list[str] | None) -> None:
    """``--kv-tiers host=8GiB,disk=/path:50GiB,remote=redis://127.0.0.1:6379/0[,remote-bytes=2GiB]``."""
    for item in items or []:
        for part in item.split(","):
            key, value = _split("--kv-tiers", part)
            name = key.replace("_", "-").lower()
            origin = f"--kv-tiers {key}={value}"
            if name == "host":
                layer.set("tiers.host_bytes", value, origin)
            elif name == "disk":
                path, sep, size = value.rpartition(":")
                if not sep or not path or not size:
                    raise UsageError(f"{origin}: expected disk=PATH:SIZE, e.g. disk=/var/cache/sage:50GiB")
                layer.set("tiers.disk_path", path, origin)
                layer.set("tiers.disk_bytes", size, origin)
            elif name == "remote":
                layer.set("tiers.remote_url", value, origin)
            elif name == "remote-bytes":
                layer.set("tiers.remote_bytes", value, origin)
            else:
                raise UsageError(f"--kv-tiers: unknown tier {key!r}; expected host, disk, remote or remote-bytes")


def add_speculative_flag(layer: CliLayer, text: str | None) -> None:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``: vLLM's flag, a JSON object
    of `speculative` fields."""
    if text is None:
        return
    example = """e.g. '{"method": "ngram", "num_speculative_tokens": 4}'"""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"--speculative-config: not JSON ({err.msg} at column {err.colno}); {example}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--speculative-config: expected a JSON object; {example}")
    for key, value in data.items():
        if isinstance(value, (dict, list)):
            raise UsageError(f"--speculative-config: {key}: expected a string or a number")
        layer.set(f"speculative.{key}", value, f"--speculative-config {key}={value}")


def add_set_flags(layer: CliLayer, items: list[str] | None) -> None:
    """``--set section.field=value`` for any `ServeConfig` field."""
    for item in items or []:
        key, value = _split("--set", item)
        dotted = key.replace("-", "_").lower()
        if dotted.split(".")[0] not in ServeConfig.model_fields:
            choices = ", ".join(sorted(ServeConfig.model_fields))
            raise UsageError(f"--set: unknown section {dotted.split('.')[0]!r}; expected one of: {choices}")
        layer.set(dotted, value, f"--set {key}={_shown(dotted, value)}")


def without_secrets(flag: str, items: list[str] | None) -> list[str]:
    """`items` of a ``--kv-transport`` or ``--set`` flag minus the ones that set a secret (to pass the
    rest on to a worker's command line; the secrets go through its environment)."""
    kept = []
    for item in items or []:
        parts = [part for part in item.split(",") if not is_secret(ServeConfig, _dotted(flag, part))]
        if parts:
            kept.append(",".join(parts))
    return kept


def _dotted(flag: str, part: str) -> list[str]:
    key = part.partition("=")[0].strip().replace("-", "_").lower()
    if flag == "--kv-transport":
        return ["kv_transport", KV_TRANSPORT_ALIASES.get(key, key)]
    return key.split(".")


def _shown(dotted: str, value: str) -> str:
    """How a flag's value appears in origins and error messages: secrets never do."""
    return "***" if is_secret(ServeConfig, dotted.split(".")) else value
