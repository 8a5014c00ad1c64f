"""Accelerator topology: one model, one parser per vendor `topo` tool.

>>> from sage_infer.hal.topology import parse_topology
>>> topo = parse_topology("nvidia", open("nvidia-smi-topo.txt").read())  # doctest: +SKIP
>>> topo.link(0, 1).link_class  # doctest: +SKIP
<LinkClass.NVLINK: 'nvlink'>

=============  ==================================  ============================
vendor key     command                             parser
=============  ==================================  ============================
``nvidia``     ``nvidia-smi topo -m``              :func:`parse_nvidia_smi_topo`
``ascend``     ``npu-smi info -t topo``            :func:`parse_npu_smi_topo`
``cambricon``  ``cnmon topo -m``                   :func:`parse_cnmon_topo`
``hygon``      ``hy-smi --showtopo --json``        :func:`parse_hy_smi_topo`
``kunlunxin``  ``xpu-smi topo -m``                 :func:`parse_xpu_smi_topo`
=============  ==================================  ============================
"""

from __future__ import annotations

from collections.abc import Callable

from .cnmon import parse_cnmon_topo
from .hy_smi import parse_hy_smi_topo
from .model import Link, LinkClass, TopoDevice, Topology, TopologyParseError, TopoNic, parse_cpu_list
from .npu_smi import parse_npu_smi_topo
from .nvidia_smi import parse_nvidia_smi_topo
from .xpu_smi import parse_xpu_smi_topo

PARSERS: dict[str, Callable[[str], Topology]] = {
    "nvidia": parse_nvidia_smi_topo,
    "ascend": parse_npu_smi_topo,
    "cambricon": parse_cnmon_topo,
    "hygon": parse_hy_smi_topo,
    "kunlunxin": parse_xpu_smi_topo,
}


def parse_topology(vendor: str, text: str) -> Topology:
    """Parse `text` with the parser registered for `vendor` (a key of :data:`PARSERS`).

    The vendor key is matched case-insensitively. Raises :class:`TopologyParseError` for an
    unknown vendor or for text the vendor's parser does not understand.
    """
    key = vendor.strip().lower() if isinstance(vendor, str) else vendor
    parser = PARSERS.get(key) if isinstance(key, str) else None
    if parser is None:
        raise TopologyParseError(f"unknown topology vendor {vendor!r}; expected one of {', '.join(sorted(PARSERS))}")
    return parser(text)


__all__ = [
    "PARSERS",
    "Link",
    "LinkClass",
    "TopoDevice",
    "TopoNic",
    "Topology",
    "TopologyParseError",
    "parse_cnmon_topo",
    "parse_cpu_list",
    "parse_hy_smi_topo",
    "parse_npu_smi_topo",
    "parse_nvidia_smi_topo",
    "parse_topology",
    "parse_xpu_smi_topo",
]
