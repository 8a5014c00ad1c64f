"""Parser for Hygon DCU ``hy-smi --showtopo --json`` (and ROCm ``rocm-smi --showtopo --json``).

hy-smi is Hygon's fork of rocm-smi and keeps its JSON vocabulary. Pair metrics are keyed
``"(Topology) <metric> between DRM devices <i> and <j>"`` with metric ``Link type``
(``XGMI`` / ``PCIE``), ``Weight`` or ``Hops``; per-device NUMA data is keyed
``"(Topology) Numa Node"`` / ``"(Topology) Numa Affinity"`` inside ``"card<N>"`` objects.
Where the pair keys live differs by release, and all of these are accepted::

    {"card0": {"(Topology) Numa Node": "0", "(Topology) Link type between DRM devices 0 and 1": "XGMI"}}
    {"card0": {"(Topology) Numa Node": "0"}, "system": {"(Topology) Link type between DRM devices 0 and 1": "XGMI"}}
    {"system": {...}}            # pairs only, devices inferred from the pair indices

The plain-text ``--showtopo`` / ``--showtopotype`` report is accepted too: the table under
the ``Link Type between two GPUs`` (or ``DCUs``) banner, plus ``GPU[0] : (Topology) Numa
Node: 0`` lines. ``XGMI`` maps to ``LinkClass.XGMI``; ``PCIE`` to ``PCIE_NUMA`` when both
devices report the same NUMA node, else ``PCIE_SYS``.
"""

from __future__ import annotations

import json
import re

from .model import Link, LinkClass, TopoDevice, Topology, TopologyParseError
from .nvidia_smi import clean_text, parse_matrix

_TOOL = "hy-smi --showtopo --json"
_EXPECTED = (
    "expected hy-smi/rocm-smi --showtopo --json output (an object with 'card<N>' keys or "
    "'(Topology) Link type between DRM devices <i> and <j>' entries) or the text 'Link Type between' table"
)
_PAIR = re.compile(r"\(Topology\)\s*(Link type|Weight|Hops)\s+between\s+DRM\s+devices\s+(\d+)\s+and\s+(\d+)", re.I)
_CARD = re.compile(r"card(\d+)", re.I)
_TEXT_NUMA = re.compile(r"(?:GPU|DCU)\[(\d+)\]\s*:\s*\(Topology\)\s*Numa Node\s*:\s*(-?\d+)", re.I)
_TEXT_TABLE = re.compile(r"Link Type between two (?:GPUs|DCUs)", re.I)


def _numa(value: object) -> int | None:
    text = str(value).strip()
    return int(text) if text.isdigit() else None  # rocm-smi prints -1 for "no NUMA"


def _build(
    names: dict[int, str], numa: dict[int, int | None], pairs: dict[tuple[int, int], dict[str, str]], source: str
) -> Topology:
    topo = Topology(vendor="hygon", source=source)
    indices = sorted(set(names) | {i for pair in pairs for i in pair})
    if not indices:
        raise TopologyParseError(f"{source}: no devices found; {_EXPECTED}")
    for idx in indices:
        topo.devices.append(TopoDevice(index=idx, name=names.get(idx, f"card{idx}"), numa_node=numa.get(idx)))
    for (a, b), info in sorted(pairs.items()):
        label = info.get("link type", "").strip()
        kind = label.upper()
        if kind == "XGMI":
            link_class = LinkClass.XGMI
        elif kind in ("PCIE", "PCI", "PCIE_SWITCH"):
            same = numa.get(a) is not None and numa.get(a) == numa.get(b)
            link_class = LinkClass.PCIE_NUMA if same else LinkClass.PCIE_SYS
        else:
            link_class = LinkClass.UNKNOWN
        topo.links.append(Link(a=a, b=b, link_class=link_class, label=label))
    return topo


def _add_pair(pairs: dict[tuple[int, int], dict[str, str]], key: str, value: object) -> bool:
    match = _PAIR.search(key)
    if not match:
        return False
    a, b = int(match.group(2)), int(match.group(3))
    if a != b:
        pairs.setdefault((min(a, b), max(a, b)), {})[match.group(1).lower()] = str(value)
    return True


def _from_json(data: object) -> Topology:
    if not isinstance(data, dict):
        raise TopologyParseError(f"{_TOOL}: top-level JSON is {type(data).__name__}; {_EXPECTED}")
    names: dict[int, str] = {}
    numa: dict[int, int | None] = {}
    affinity: dict[int, int | None] = {}
    pairs: dict[tuple[int, int], dict[str, str]] = {}
    for key, value in data.items():
        card = _CARD.fullmatch(str(key).strip())
        if card:
            names[int(card.group(1))] = str(key).strip()
        if not isinstance(value, dict):
            _add_pair(pairs, str(key), value)
            continue
        for sub_key, sub_value in value.items():
            sub_key = str(sub_key)
            if _add_pair(pairs, sub_key, sub_value) or not card:
                continue
            lowered = sub_key.lower()
            if "numa node" in lowered:
                numa[int(card.group(1))] = _numa(sub_value)
            elif "numa affinity" in lowered:
                affinity[int(card.group(1))] = _numa(sub_value)
    for idx, node in affinity.items():
        if numa.get(idx) is None:
            numa[idx] = node
    return _build(names, numa, pairs, _TOOL)


def _from_text(text: str) -> Topology:
    source = "hy-smi --showtopo"
    banner = _TEXT_TABLE.search(text)
    if banner is None:
        raise TopologyParseError(f"{source}: no JSON object and no 'Link Type between' table; {_EXPECTED}")
    section = text[banner.end() :]
    prefix = "DCU" if re.search(r"^\s*DCU\d+", section, re.M) else "GPU"
    table = parse_matrix(section, tool=source, device_prefix=prefix)
    pos = {name: i for i, name in enumerate(table.columns)}
    index = {name: int(name[len(prefix) :]) for name in table.device_columns}
    pairs: dict[tuple[int, int], dict[str, str]] = {}
    for a in table.device_columns:
        for b in table.device_columns:
            if index[a] < index[b]:
                pairs[(index[a], index[b])] = {"link type": table.rows[a][pos[b]]}
    numa = {int(i): _numa(n) for i, n in _TEXT_NUMA.findall(text)}
    return _build({v: k for k, v in index.items()}, numa, pairs, source)


def parse_hy_smi_topo(text: str) -> Topology:
    """Parse ``hy-smi --showtopo --json`` / ``rocm-smi --showtopo --json`` into a :class:`Topology`.

    JSON is the supported form (see the module docstring for the accepted shapes); the
    plain-text ``--showtopo`` report is a fallback. Devices are named ``card<N>`` from
    JSON, ``GPU<N>`` / ``DCU<N>`` from text.
    """
    text = clean_text(text, _TOOL)
    start, end = text.find("{"), text.rfind("}")
    if text.lstrip().startswith("["):  # JSON, but not the object hy-smi prints
        start, end = text.find("["), text.rfind("]")
    if start != -1 and end > start and not _TEXT_TABLE.search(text[:start]):
        try:
            data = json.loads(text[start : end + 1])
        except json.JSONDecodeError as exc:
            raise TopologyParseError(
                f"{_TOOL}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {_EXPECTED}"
            ) from None
        return _from_json(data)
    return _from_text(text)
