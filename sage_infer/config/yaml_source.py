"""Read YAML and remember the line of every key, so errors can point at it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sage_infer.errors import ConfigError

# Values (keys, scalars, lists, mappings) a document may hold once its aliases are expanded.
MAX_EXPANDED_NODES = 100_000


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
    """Parse `path`; a missing file, YAML error, alias bomb or non-mapping top level is a `ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    node, data = _parse(path, text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of fields at the top level, got {type(data).__name__}")
    lines: dict[str, int] = {}
    if node is not None:
        _record_lines(node, "", lines)
    return YamlDoc(path=path, data=data, lines=lines)


def _parse(path: Path, text: str) -> tuple[yaml.Node | None, object]:
    """Compose the node graph, refuse it if aliases blow it up, then construct the data."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _expanded_size(path, node, {}, set())
        return node, (loader.construct_document(node) if node is not None else None)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = " ".join(filter(None, [err.context, err.problem])) or "invalid YAML"
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML error: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML is nested too deeply to be a config file") from None
    finally:
        loader.dispose()


def _expanded_size(path: Path, node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes in `node` once every alias is copied out, counted without copying anything.

    PyYAML shares one node (and one constructed object) per anchor, so parsing an alias
    bomb is cheap; whatever walks the result later (line recording, merging, validation,
    dumping) visits every alias separately. Memoised per node, so this is linear in the
    file. A config file has at most a few thousand values, so a limit far above that
    refuses only documents built to expand.
    """
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: YAML alias refers to a value that contains it")
    children: list[yaml.Node] = []
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    open_nodes.add(key)
    size = 1 + sum(_expanded_size(path, child, sizes, open_nodes) for child in children)
    open_nodes.discard(key)
    if size > MAX_EXPANDED_NODES:
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: YAML aliases expand this value to more than "
                          f"{MAX_EXPANDED_NODES:,} values; a config file needs no aliases that large")
    sizes[key] = size
    return size


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
