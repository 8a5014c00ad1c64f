"""Parser for ``nvidia-smi topo -m``, plus the matrix reader the look-alike tools reuse.

``nvidia-smi topo -m`` prints a device-by-device matrix::

    \tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
    GPU0\t X \tNV18\tPIX\t0-55,112-167\t0\t\tN/A
    GPU1\tNV18\t X \tNODE\t0-55,112-167\t0\t\tN/A
    NIC0\tPIX\tNODE\t X
    ...
    Legend:
      X    = Self
      ...
    NIC Legend:
      NIC0: mlx5_0

Older drivers name the NIC columns directly (``mlx5_0``), print no ``NUMA Affinity`` /
``GPU NUMA ID`` columns, and use ``SOC`` for what is now ``SYS``. ``npu-smi info -t topo``,
``xpu-smi topo -m`` and ``cnmon topo -m`` copy this layout, so :func:`parse_matrix` and
:func:`matrix_to_topology` are shared with their parsers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .model import Link, LinkClass, TopoDevice, Topology, TopologyParseError, TopoNic, parse_cpu_list

Classifier = Callable[[str], tuple[LinkClass, int | None]]

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_ATTR_NAMES = re.compile(r"CPU Affinity|NUMA Affinity|[A-Z]+ NUMA ID|NUMA ID")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", re.MULTILINE)
_NA = {"", "N/A", "NA", "-", "NONE"}

PCIE_LABELS = {
    "X": LinkClass.SELF,
    "PIX": LinkClass.PCIE_SWITCH,
    "PXB": LinkClass.PCIE_SWITCH,
    "PHB": LinkClass.PCIE_HOST_BRIDGE,
    "NODE": LinkClass.PCIE_NUMA,
    "SYS": LinkClass.PCIE_SYS,
    "SOC": LinkClass.PCIE_SYS,  # drivers before ~384 called the inter-socket path SOC
}
_NV_LANES = re.compile(r"NV(\d+)")


@dataclass(slots=True)
class MatrixTable:
    """The raw cells of an nvidia-smi-style topology matrix.

    `columns` are the link columns in header order (devices and NICs); `rows` maps a row
    name to its link cells (one per column); `attrs` maps a row name to the trailing
    attribute columns it filled (``"CPU Affinity"``, ``"NUMA Affinity"``, ...).
    """

    columns: list[str]
    device_columns: list[str]
    rows: dict[str, list[str]] = field(default_factory=dict)
    attrs: dict[str, dict[str, str]] = field(default_factory=dict)
    nic_legend: dict[str, str] = field(default_factory=dict)


def clean_text(text: object, tool: str) -> str:
    """Return `text` as ``str`` with ANSI colour codes and carriage returns removed."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise TopologyParseError(f"{tool}: expected the command's text output, got {type(text).__name__}")
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        raise TopologyParseError(f"{tool}: empty input; expected the matrix printed by `{tool}`")
    return text


def parse_matrix(text: object, *, tool: str, device_prefix: str, phrases: Iterable[str] = ()) -> MatrixTable:
    """Read the header, rows and NIC legend of an nvidia-smi-style matrix.

    The header is the first line whose first word is ``<device_prefix><N>``; its words up
    to ``CPU Affinity`` / ``NUMA ...`` are the link columns. Each row starting with a
    column name gives one cell per column (whitespace separated; tabs and ANSI codes are
    ignored), then its attribute values. `phrases` are regexes for multi-word labels
    (``MULTIPLE\\s+SWITCH``) that count as one cell; the cell keeps the words, joined by
    one space. Raises :class:`TopologyParseError` when the header, a device row, or a cell
    is missing.
    """
    lines = clean_text(text, tool).split("\n")
    dev_re = re.compile(rf"{re.escape(device_prefix)}\d+")
    start = next((i for i, ln in enumerate(lines) if ln.split() and dev_re.fullmatch(ln.split()[0])), None)
    if start is None:
        raise TopologyParseError(
            f"{tool}: expected a matrix header starting with {device_prefix}0 "
            f"(e.g. '{device_prefix}0 {device_prefix}1 ... CPU Affinity'), found none"
        )
    tokens = lines[start].split()
    columns: list[str] = []
    attr_text = ""
    for i, tok in enumerate(tokens):
        if tok in ("CPU", "NUMA") or (i + 1 < len(tokens) and tokens[i + 1] == "NUMA"):
            attr_text = " ".join(tokens[i:])
            break
        columns.append(tok)
    if len(set(columns)) != len(columns):
        raise TopologyParseError(f"{tool}: duplicate column names in matrix header {columns}")
    attr_names = _ATTR_NAMES.findall(attr_text)
    table = MatrixTable(columns=columns, device_columns=[c for c in columns if dev_re.fullmatch(c)])
    known = set(columns)
    cell_re = re.compile("|".join([rf"\b(?:{p})\b" for p in phrases] + [r"\S+"]), re.IGNORECASE)
    last = max(i for i, ln in enumerate(lines) if ln.strip())
    for number, line in enumerate(lines[start + 1 :], start + 1):
        if line.strip().startswith(("Legend", "NIC Legend")):
            break
        words = [" ".join(w.split()) for w in cell_re.findall(line)]
        if not words or words[0] not in known or words[0] in table.rows:
            continue
        cells = words[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            raise TopologyParseError(
                f"{tool}: row {words[0]} has {len(cells)} link cells, expected {len(columns)} (truncated output?)"
            )
        values = words[1 + len(columns) :]
        if number == last and words[0] in table.device_columns and len(values) < len(attr_names):
            raise TopologyParseError(f"{tool}: output ends inside row {words[0]} (truncated output?)")
        table.rows[words[0]] = cells
        table.attrs[words[0]] = dict(zip(attr_names, values, strict=False))
    missing = [c for c in table.device_columns if c not in table.rows]
    if missing:
        raise TopologyParseError(
            f"{tool}: expected a row for each of {', '.join(table.device_columns)}; "
            f"missing {', '.join(missing)} (truncated output?)"
        )
    table.nic_legend = dict(_NIC_LEGEND.findall("\n".join(lines[start:])))
    return table


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def matrix_to_topology(
    table: MatrixTable, *, vendor: str, source: str, tool: str, device_prefix: str, classify: Classifier
) -> Topology:
    """Turn a :class:`MatrixTable` into a :class:`Topology` using `classify` for labels.

    `classify` maps one raw cell (``"NV18"``, ``"HCCS"``) to ``(LinkClass, lanes)``.
    ``CPU Affinity`` is expanded into ``TopoDevice.cpus``; ``NUMA Affinity`` becomes
    ``numa_node`` when it is a single number.
    """
    topo = Topology(vendor=vendor, source=source)
    pos = {name: i for i, name in enumerate(table.columns)}
    index: dict[str, int] = {}
    for name in table.device_columns:
        idx = int(name[len(device_prefix) :])
        attrs = table.attrs.get(name, {})
        affinity = attrs.get("CPU Affinity")
        affinity = None if affinity is None or affinity.upper() in _NA else affinity
        try:
            cpus = parse_cpu_list(affinity) if affinity else []
        except ValueError:
            raise TopologyParseError(f"{tool}: {name} has an unreadable CPU Affinity {affinity!r}") from None
        numa = _int_or_none(attrs.get("NUMA Affinity"))
        topo.devices.append(TopoDevice(index=idx, name=name, cpu_affinity=affinity, cpus=cpus, numa_node=numa))
        index[name] = idx
    devs = table.device_columns
    for i, a in enumerate(devs):
        for b in devs[i + 1 :]:
            label = table.rows[a][pos[b]]
            if label.upper() in _NA:
                label = table.rows[b][pos[a]]
            link_class, lanes = classify(label)
            lo, hi = sorted((index[a], index[b]))
            topo.links.append(Link(a=lo, b=hi, link_class=link_class, label=label, lanes=lanes))
    for col in table.columns:
        if col in index:
            continue
        nic = TopoNic(name=table.nic_legend.get(col, col))
        for dev in devs:
            nic.device_links[index[dev]] = classify(table.rows[dev][pos[col]])[0]
        topo.nics.append(nic)
    return topo


def classify_nvidia(label: str) -> tuple[LinkClass, int | None]:
    """Map an nvidia-smi cell to ``(LinkClass, lanes)``: ``NV18`` -> NVLINK with 18 lanes."""
    word = label.strip().upper()
    match = _NV_LANES.fullmatch(word)
    if match:
        return LinkClass.NVLINK, int(match.group(1))
    return PCIE_LABELS.get(word, LinkClass.UNKNOWN), None


def parse_nvidia_smi_topo(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m`` (old and new layouts) into a :class:`Topology`.

    Accepts the matrix with ``GPU<N>`` rows/columns, NIC columns named ``mlx5_N`` (old) or
    ``NIC<N>`` with a ``NIC Legend:`` block (new), and the trailing ``CPU Affinity``,
    ``NUMA Affinity`` and ``GPU NUMA ID`` columns when present. Labels: ``X`` self,
    ``NV#`` NVLink with # lanes, ``PIX``/``PXB`` PCIe switch, ``PHB`` host bridge, ``NODE``
    same NUMA node, ``SYS``/``SOC`` across sockets.
    """
    tool = "nvidia-smi topo -m"
    table = parse_matrix(text, tool=tool, device_prefix="GPU")
    return matrix_to_topology(
        table, vendor="nvidia", source=tool, tool=tool, device_prefix="GPU", classify=classify_nvidia
    )
