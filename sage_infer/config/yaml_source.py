"""Read YAML and remember the line of every key, so errors can point at it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sage_infer.errors import ConfigError


@dataclass(slots=True)
class YamlDoc:
    """A parsed YAML mapping plus ``dotted.path -> 1-based line`` for every key."""

    path: Path
    data: dict
    lines: dict[str, int] = field(default_factory=dict)

    def line_of(self, dotted: str) -> int | None:
        """Line of `dotted`, or of its nearest ancestor that the file sets."""
        parts = dotted.split(".")
        while parts:
            line = self.lines.get(".".join(parts))
            if line is not None:
                return line
            parts.pop()
        return None

    def where(self, dotted: str) -> str:
        line = self.line_of(dotted)
        return f"{self.path}:{line}" if line else str(self.path)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path | str) -> YamlDoc:
    """Parse `path`; a missing file, YAML error or non-mapping top level is a `ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = " ".join(filter(None, [err.context, err.problem])) or "invalid YAML"
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML error: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of fields at the top level, got {type(data).__name__}")
    lines: dict[str, int] = {}
    if node is not None:
        _record_lines(node, "", lines)
    return YamlDoc(path=path, data=data, lines=lines)


def _record_lines(node: yaml.Node, prefix: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[dotted] = key_node.start_mark.line + 1
            _record_lines(value_node, dotted, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            dotted = f"{prefix}.{i}"
            lines[dotted] = item.start_mark.line + 1
            _record_lines(item, dotted, lines)
