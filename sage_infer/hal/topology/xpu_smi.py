"""Parser for Kunlunxin ``xpu-smi topo -m``.

Kunlunxin's ``xpu-smi`` copies the nvidia-smi layout: ``XPU<N>`` rows and columns, NIC
columns ``NIC<N>`` resolved by a ``NIC Legend:`` block (``NIC0: mlx5_bond_0``), then
``CPU Affinity`` and ``NUMA Affinity``. On P800 OAM nodes the XPUs of one group are joined
by XPU Link, printed ``XL``; other pairs show the PCIe labels ``PIX`` / ``PXB`` / ``PHB`` /
``NODE`` / ``SYS``. Some builds spell the link out (``XPU Link``) or add a lane count
(``XL2``); both are accepted.

(Intel's unrelated ``xpu-smi topology -m`` prints ``GPU <n>/<tile>`` rows and is not
handled here.)
"""

from __future__ import annotations

import re

from .model import LinkClass, Topology
from .nvidia_smi import PCIE_LABELS, matrix_to_topology, parse_matrix

_TOOL = "xpu-smi topo -m"

_PCIE = {k: v for k, v in PCIE_LABELS.items() if k != "SOC"}  # xpu-smi copies nvidia-smi's labels
_XPU_LINK = re.compile(r"(?:XL|XPU_?LINK|XLINK)(\d*)")
_PHRASES = (r"XPU\s+LINK",)


def classify_kunlunxin(label: str) -> tuple[LinkClass, int | None]:
    """Map an xpu-smi cell to ``(LinkClass, lanes)``: ``XL`` / ``XPU Link`` -> XPU_LINK."""
    word = re.sub(r"[\s_-]+", "_", label.strip().upper())
    match = _XPU_LINK.fullmatch(word)
    if match:
        return LinkClass.XPU_LINK, int(match.group(1)) if match.group(1) else None
    return _PCIE.get(word, LinkClass.UNKNOWN), None


def parse_xpu_smi_topo(text: str) -> Topology:
    """Parse Kunlunxin ``xpu-smi topo -m`` (P800 / R300 nodes) into a :class:`Topology`.

    Takes the ``XPU<N>`` matrix with optional ``NIC<N>`` columns, ``CPU Affinity`` and
    ``NUMA Affinity`` columns, and the ``NIC Legend:`` block.
    """
    table = parse_matrix(text, tool=_TOOL, device_prefix="XPU", phrases=_PHRASES)
    return matrix_to_topology(
        table, vendor="kunlunxin", source=_TOOL, tool=_TOOL, device_prefix="XPU", classify=classify_kunlunxin
    )
