"""Parser for Cambricon ``cnmon topo -m``.

``cnmon topo -m`` prints an nvidia-smi-style matrix of ``MLU<N>`` rows and columns with a
``CPU Affinity`` column. The relation in each cell comes from CNDev's
``cndevTopologyRelationshipEnum_t`` (SELF, INTERNAL, SINGLE, MULTIPLE, HOST_BRIDGE, CPU,
SYSTEM) plus MLU-Link. Depending on the release the cell is a short label or the relation
spelled out; both are accepted, case-insensitively:

============  ===============================  ==================
short label   relation word(s)                 LinkClass
============  ===============================  ==================
X / SLF       SELF                             SELF
MLK           MLU-Link, MLU Link, MLULINK      MLU_LINK
INT           INTERNAL (same board)            PCIE_SWITCH
SIN / PIX     SINGLE, SINGLE SWITCH            PCIE_SWITCH
MUL / PXB     MULTIPLE, MULTIPLE SWITCH(ES)    PCIE_SWITCH
HOB / PHB     HOST BRIDGE, HOSTBRIDGE          PCIE_HOST_BRIDGE
CPU / NODE    CPU (same socket)                PCIE_NUMA
SYS           SYSTEM                           PCIE_SYS
============  ===============================  ==================

A cell that names both a PCIe relation and MLU-Link (``MUL/MLK``, ``MUL+MLK``) is
classified MLU_LINK, the faster path. No NUMA column is printed.
"""

from __future__ import annotations

import re

from .model import LinkClass, Topology
from .nvidia_smi import matrix_to_topology, parse_matrix

_TOOL = "cnmon topo -m"

_LABELS = {
    LinkClass.SELF: ("X", "SELF", "SLF"),
    LinkClass.MLU_LINK: ("MLK", "MLU_LINK", "MLULINK", "ML"),
    LinkClass.PCIE_SWITCH: (
        "INT",
        "INTERNAL",
        "SIN",
        "SINGLE",
        "SINGLE_SWITCH",
        "PIX",
        "MUL",
        "MULTIPLE",
        "MULTIPLE_SWITCH",
        "MULTIPLE_SWITCHES",
        "PXB",
    ),
    LinkClass.PCIE_HOST_BRIDGE: ("HOB", "HOST_BRIDGE", "HOSTBRIDGE", "PHB"),
    LinkClass.PCIE_NUMA: ("CPU", "NODE"),
    LinkClass.PCIE_SYS: ("SYS", "SYSTEM"),
}
_BY_WORD = {word: cls for cls, words in _LABELS.items() for word in words}
_MLK_LANES = re.compile(r"MLK(\d+)")
_PHRASES = (r"MULTIPLE\s+SWITCH(?:ES)?", r"SINGLE\s+SWITCH", r"HOST\s+BRIDGE", r"MLU\s+LINK")


def _classify_word(word: str) -> tuple[LinkClass, int | None]:
    word = re.sub(r"[\s_-]+", "_", word.strip())
    match = _MLK_LANES.fullmatch(word)
    if match:
        return LinkClass.MLU_LINK, int(match.group(1))
    return _BY_WORD.get(word, LinkClass.UNKNOWN), None


def classify_cambricon(label: str) -> tuple[LinkClass, int | None]:
    """Map a cnmon cell (short label or relation word) to ``(LinkClass, lanes)``."""
    parts = [p for p in re.split(r"[/,+|]", label.strip().upper()) if p]
    results = [_classify_word(p) for p in parts] or [(LinkClass.UNKNOWN, None)]
    for result in results:
        if result[0] is LinkClass.MLU_LINK:
            return result
    return results[0]


def parse_cnmon_topo(text: str) -> Topology:
    """Parse Cambricon ``cnmon topo -m`` (MLU370 / MLU590 nodes) into a :class:`Topology`.

    Takes the ``MLU<N>`` matrix with a ``CPU Affinity`` column; cells may be short labels
    (``MLK``, ``MUL``, ``CPU``) or relation words (``MULTIPLE SWITCH``, ``HOST BRIDGE``).
    """
    table = parse_matrix(text, tool=_TOOL, device_prefix="MLU", phrases=_PHRASES)
    return matrix_to_topology(
        table, vendor="cambricon", source=_TOOL, tool=_TOOL, device_prefix="MLU", classify=classify_cambricon
    )
