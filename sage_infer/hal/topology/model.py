"""One topology model for every vendor's `topo` output.

Each vendor tool prints a device-by-device matrix with its own link vocabulary
(`NV18`, `HCCS`, `MLU-Link`, `XGMI`, `XPU Link`, `PIX`, `SYS`, ...). The parsers in
this package turn that text into a :class:`Topology`: devices, one :class:`Link` per
unordered device pair with a vendor-neutral :class:`LinkClass`, CPU/NUMA affinity per
device, and the NICs the tool listed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class LinkClass(str, enum.Enum):
    """Vendor-neutral class of a device-to-device path, fastest first."""

    SELF = "self"  # the same device
    NVLINK = "nvlink"  # NVIDIA NVLink (direct or through NVSwitch)
    HCCS = "hccs"  # Huawei Cache Coherence System (Ascend)
    MLU_LINK = "mlu-link"  # Cambricon MLU-Link
    XGMI = "xgmi"  # AMD/Hygon Infinity Fabric (xGMI)
    XPU_LINK = "xpu-link"  # Kunlunxin XPU Link
    PCIE_SWITCH = "pcie-switch"  # one PCIe switch (nvidia PIX/PXB)
    PCIE_HOST_BRIDGE = "pcie-host-bridge"  # through a CPU host bridge (nvidia PHB)
    PCIE_NUMA = "pcie-numa"  # PCIe plus the interconnect inside one NUMA node (NODE)
    PCIE_SYS = "pcie-sys"  # PCIe plus the inter-socket link (SYS, QPI/UPI)
    UNKNOWN = "unknown"

    @property
    def is_device_link(self) -> bool:
        """True for a dedicated accelerator-to-accelerator fabric (not PCIe)."""
        return self in _DEVICE_LINKS


_DEVICE_LINKS = {LinkClass.NVLINK, LinkClass.HCCS, LinkClass.MLU_LINK, LinkClass.XGMI, LinkClass.XPU_LINK}


@dataclass(slots=True)
class TopoDevice:
    """One accelerator as the vendor tool names it.

    `index` is the tool's device index; `cpu_affinity` is the CPU list string the tool
    printed (e.g. ``"0-47,96-143"``), expanded in `cpus`; `numa_node` is ``None`` when the
    tool did not say.
    """

    index: int
    name: str
    cpu_affinity: str | None = None
    cpus: list[int] = field(default_factory=list)
    numa_node: int | None = None


@dataclass(slots=True)
class Link:
    """The path between two devices (`a` < `b`), as the vendor labelled it.

    `label` keeps the raw text (``"NV18"``, ``"HCCS"``, ``"SYS"``); `lanes` is the
    number of bonded links where the label says it (``NV18`` -> 18); `bandwidth_gb_s`
    is filled in by the caller from a hardware preset when the tool does not print it.
    """

    a: int
    b: int
    link_class: LinkClass
    label: str
    lanes: int | None = None
    bandwidth_gb_s: float | None = None


@dataclass(slots=True)
class TopoNic:
    """A NIC the topology tool listed (e.g. ``mlx5_0``), with its path to each device."""

    name: str
    device_links: dict[int, LinkClass] = field(default_factory=dict)


@dataclass(slots=True)
class Topology:
    """Devices, pairwise links, and NICs of one node, parsed from a vendor tool."""

    vendor: str
    source: str  # the command whose output this came from
    devices: list[TopoDevice] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    nics: list[TopoNic] = field(default_factory=list)

    def link(self, a: int, b: int) -> Link | None:
        """The link between devices `a` and `b` (order does not matter)."""
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if link.a == lo and link.b == hi:
                return link
        return None

    def link_classes(self) -> set[LinkClass]:
        return {link.link_class for link in self.links}

    def to_dict(self) -> dict:
        return {
            "vendor": self.vendor,
            "source": self.source,
            "devices": [
                {"index": d.index, "name": d.name, "cpu_affinity": d.cpu_affinity, "numa_node": d.numa_node}
                for d in self.devices
            ],
            "links": [
                {
                    "a": link.a,
                    "b": link.b,
                    "class": link.link_class.value,
                    "label": link.label,
                    "lanes": link.lanes,
                    "bandwidth_gb_s": link.bandwidth_gb_s,
                }
                for link in self.links
            ],
            "nics": [
                {"name": n.name, "device_links": {str(k): v.value for k, v in n.device_links.items()}}
                for n in self.nics
            ],
        }


class TopologyParseError(ValueError):
    """The text is not the output this parser understands; the message says what was expected."""


def parse_cpu_list(text: str) -> list[int]:
    """Expand a Linux CPU list such as ``"0-3,8,10-11"`` into ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus
