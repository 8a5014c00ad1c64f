"""Parser for Huawei Ascend ``npu-smi info -t topo``.

The tool prints an nvidia-smi-style matrix of ``NPU<N>`` rows and columns with a
trailing ``CPU Affinity`` column, then a legend::

               NPU0       NPU1       ...    CPU Affinity
    NPU0       X          HCCS       ...    144-167
    NPU1       HCCS       X          ...    144-167

    Legend:

      X    = Self
      SYS  = Path traversing PCIe and NUMA nodes. Nodes are connected through SMP, such as QPI, UPI.
      PHB  = Path traversing PCIe and the PCIe host bridge of a CPU.
      PIX  = Path traversing a single PCIe switch
      PXB  = Path traversing multiple PCIe switches
      HCCS = Connection traversing HCCS.
      NA   = Unknown relationship.

Atlas 800T/800I A2 (910B) boards show ``HCCS`` for every pair; PCIe inference cards
(Atlas 300I / 310P) show ``PIX`` / ``PHB`` / ``SYS``. Newer CANN releases add ``SIO``
(die-to-die inside one module) and ``UB`` (unified bus), which are Ascend device fabrics
too. The header line may start at column 0 (no leading blank) on some releases.
"""

from __future__ import annotations

from .model import LinkClass, Topology
from .nvidia_smi import matrix_to_topology, parse_matrix

_TOOL = "npu-smi info -t topo"

_LABELS = {
    "X": LinkClass.SELF,
    "HCCS": LinkClass.HCCS,
    "HCCS_SW": LinkClass.HCCS,  # through an HCCS switch (A3 super-pod boards)
    "SIO": LinkClass.HCCS,  # two dies of one module
    "UB": LinkClass.HCCS,  # unified bus (Ascend 950 generation)
    "PIX": LinkClass.PCIE_SWITCH,
    "PXB": LinkClass.PCIE_SWITCH,
    "PHB": LinkClass.PCIE_HOST_BRIDGE,
    "NODE": LinkClass.PCIE_NUMA,
    "SYS": LinkClass.PCIE_SYS,
    "NA": LinkClass.UNKNOWN,
}


def classify_ascend(label: str) -> tuple[LinkClass, int | None]:
    """Map an npu-smi cell (``HCCS``, ``PIX``, ``SYS``, ``NA`` ...) to ``(LinkClass, None)``."""
    return _LABELS.get(label.strip().upper(), LinkClass.UNKNOWN), None


def parse_npu_smi_topo(text: str) -> Topology:
    """Parse ``npu-smi info -t topo`` (Ascend 910/910B/310P) into a :class:`Topology`.

    Takes the ``NPU<N>`` matrix with a ``CPU Affinity`` column and the legend below it.
    The tool prints no NUMA column, so ``numa_node`` stays ``None``.
    """
    table = parse_matrix(text, tool=_TOOL, device_prefix="NPU")
    return matrix_to_topology(
        table, vendor="ascend", source=_TOOL, tool=_TOOL, device_prefix="NPU", classify=classify_ascend
    )
