"""The host CPU: cores, NUMA nodes (from /sys), memory, and measured copy bandwidth."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sage_infer.hal.topology.model import parse_cpu_list

SYS_NODE_DIR = Path("/sys/devices/system/node")
SYS_CPU_DIR = Path("/sys/devices/system/cpu")


@dataclass(slots=True)
class NumaNode:
    node: int
    cpus: list[int]
    memory_bytes: int | None = None


@dataclass(slots=True)
class CpuInfo:
    model_name: str
    logical_cores: int
    physical_cores: int | None
    sockets: int | None
    memory_bytes: int | None
    numa_nodes: list[NumaNode] = field(default_factory=list)
    memcpy_gb_s: float | None = None  # measured, single thread, large buffers

    def to_dict(self) -> dict:
        return {
            "model_name": self.model_name,
            "logical_cores": self.logical_cores,
            "physical_cores": self.physical_cores,
            "sockets": self.sockets,
            "memory_bytes": self.memory_bytes,
            "numa_nodes": [
                {"node": n.node, "cpus": _compact(n.cpus), "memory_bytes": n.memory_bytes} for n in self.numa_nodes
            ],
            "memcpy_gb_s": self.memcpy_gb_s,
        }


def read_numa_nodes(node_dir: Path = SYS_NODE_DIR) -> list[NumaNode]:
    """NUMA nodes as Linux lists them in ``/sys/devices/system/node/node*/``."""
    nodes = []
    for path in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpu_list((path / "cpulist").read_text().strip())
        except (OSError, ValueError):
            continue
        nodes.append(NumaNode(node=int(path.name[4:]), cpus=cpus, memory_bytes=_node_memory(path / "meminfo")))
    return nodes


def _node_memory(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            # "Node 0 MemTotal:       65843052 kB"
            if "MemTotal:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_meminfo_total(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_mem_available(path: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the kernel estimates can be allocated without swapping (``MemAvailable``)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_cpu_model(path: Path = Path("/proc/cpuinfo")) -> tuple[str, int | None, int | None]:
    """(model name, physical cores, sockets) from ``/proc/cpuinfo``."""
    model, cores, sockets = "unknown", set(), set()
    try:
        physical_id = None
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and model == "unknown":
                model = value
            elif key == "physical id":
                physical_id = value
                sockets.add(value)
            elif key == "core id":
                cores.add((physical_id, value))
    except OSError:
        return model, None, None
    return model, (len(cores) or None), (len(sockets) or None)


def measure_memcpy_gb_s(size_bytes: int = 256 * 1024 * 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` host copy bandwidth (bytes read + written counted once), GB/s.

    Uses torch so the copy runs in optimized native code, the same path the KV pool
    and host tier use.
    """
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return size_bytes / best / 1e9


def probe_cpu(measure: bool = True) -> CpuInfo:
    model, physical, sockets = read_cpu_model()
    return CpuInfo(
        model_name=model,
        logical_cores=os.cpu_count() or 1,
        physical_cores=physical,
        sockets=sockets,
        memory_bytes=read_meminfo_total(),
        numa_nodes=read_numa_nodes(),
        memcpy_gb_s=round(measure_memcpy_gb_s(), 2) if measure else None,
    )


def _compact(cpus: list[int]) -> str:
    """Inverse of `parse_cpu_list`: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    if not cpus:
        return ""
    parts, start, prev = [], cpus[0], cpus[0]
    for cpu in cpus[1:] + [None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)
