"""From a hardware report to a preset name, a `KVTransportConfig` and a preset file."""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass, field

import yaml

from sage_infer.config.presets import list_presets, load_hardware_preset
from sage_infer.config.transport import KVTransportConfig
from sage_infer.hal.detect import HardwareReport

MIB = 1024 * 1024


def match_preset(report: HardwareReport) -> str:
    """The shipped hardware preset whose `model_names` match this machine's devices."""
    vendor = report.primary_vendor
    if vendor == "cpu":
        return "cpu"
    names = [d.name.lower() for d in report.accelerators if d.vendor == vendor]
    candidates = []
    for preset in list_presets("hardware"):
        profile = load_hardware_preset(preset).profile
        if profile.vendor.value != vendor:
            continue
        candidates.append(preset)
        if any(m.lower() in n for m in profile.device.model_names for n in names):
            return preset
    return candidates[0] if candidates else "cpu"


@dataclass(slots=True)
class TransportRecommendation:
    config: KVTransportConfig
    reasons: list[str] = field(default_factory=list)

    def flags(self) -> str:
        """The recommendation as ``--kv-transport`` flags."""
        values = self.config.model_dump(exclude_defaults=True, mode="json")
        if "chunk_size" in values:
            values["chunk_size"] = human_bytes(values["chunk_size"])
        return " ".join(f"--kv-transport {k.replace('_', '-')}={v}" for k, v in values.items())


def human_bytes(n: int) -> str:
    """Exact binary units where possible: 16777216 -> ``16MiB`` (parses back as the same size)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def annotate_link_bandwidths(report: HardwareReport, preset: str) -> None:
    """Fill `Link.bandwidth_gb_s` (per direction) from the preset where the tool printed none.

    Device fabrics: per-link GB/s x lanes when the label gives lanes (``NV18``), else the
    aggregate halved (aggregates count both directions). PCIe paths: the host link.
    """
    profile = load_hardware_preset(preset).profile
    fabric = profile.intra_node_link
    for vendor in report.vendors:
        for link in vendor.topology.links if vendor.topology else []:
            if link.bandwidth_gb_s is not None:
                continue
            if link.link_class.is_device_link:
                if link.lanes and fabric.per_link_gb_s:
                    link.bandwidth_gb_s = round(link.lanes * fabric.per_link_gb_s, 1)
                elif fabric.aggregate_gb_s:
                    link.bandwidth_gb_s = round(fabric.aggregate_gb_s / 2, 1)
            elif link.link_class.value.startswith("pcie"):
                link.bandwidth_gb_s = profile.host_link.bandwidth_gb_s


def recommend_transport(report: HardwareReport, preset: str) -> TransportRecommendation:
    """Rules, each with its reason: fabric between devices -> high-bw; host only -> shm
    with chunks sized to about 1 ms of measured copy bandwidth."""
    profile = load_hardware_preset(preset).profile
    reasons: list[str] = []
    accelerators = report.accelerators
    topology_links = {
        link.link_class for v in report.vendors if v.available and v.topology for link in v.topology.links
    }
    fabric = sorted(c.value for c in topology_links if c.is_device_link)
    if len(accelerators) > 1 and (fabric or profile.intra_node_link.kind not in ("none", "pcie")):
        via = ", ".join(fabric) or profile.intra_node_link.kind
        reasons.append(f"{len(accelerators)} devices linked by {via}: big chunks, many in flight")
        config = KVTransportConfig(preset="high-bw", backend="torchdist", chunk_size=16 * MIB, max_inflight=32)
        return TransportRecommendation(config, reasons)
    if accelerators:
        reasons.append(f"{len(accelerators)} device(s) without a device fabric: host-staged copies")
        backend = next((b for b in profile.transport.backends if b != "rdma"), "tcp")
        return TransportRecommendation(KVTransportConfig(backend=backend, chunk_size=4 * MIB), reasons)
    bandwidth = report.cpu.memcpy_gb_s
    chunk = 4 * MIB
    if bandwidth:
        target = bandwidth * 1e9 * 1e-3  # bytes copied in ~1 ms
        chunk = max(256 * 1024, min(64 * MIB, 1 << int(target).bit_length() - 1))
        reasons.append(f"host copy measured at {bandwidth:.1f} GB/s: {chunk // 1024} KiB chunks take ~1 ms")
    reasons.append("no accelerator: KV moves between processes through shared memory")
    cores = report.cpu.logical_cores
    config = KVTransportConfig(backend="shm", chunk_size=chunk, max_inflight=max(2, min(8, cores)))
    return TransportRecommendation(config, reasons)


def measured_preset_yaml(report: HardwareReport, base: str, name: str) -> str:
    """A hardware preset that extends `base` with what was measured here."""
    profile = load_hardware_preset(base).profile
    data: dict = {"extends": base, "name": name}
    stamp = datetime.date.today().isoformat()
    ref = f"sage transport probe on {platform.node()} ({stamp})"
    sources: dict = {}
    accelerators = report.accelerators
    if accelerators:
        data["device"] = {"devices_per_node": len(accelerators)}
        sources["device.devices_per_node"] = {"confidence": "measured", "ref": ref}
        memory = min(d.memory_bytes for d in accelerators)
        if memory:
            data["memory"] = {"hbm_gb": round(memory / 1e9, 1)}
            sources["memory.hbm_gb"] = {"confidence": "measured", "ref": ref}
    else:
        memory = {}
        if report.cpu.memory_bytes:
            memory["hbm_gb"] = round(report.cpu.memory_bytes / 1e9, 1)
            sources["memory.hbm_gb"] = {"confidence": "measured", "ref": ref + ", /proc/meminfo"}
        if report.cpu.memcpy_gb_s:
            memory["bandwidth_gb_s"] = report.cpu.memcpy_gb_s
            sources["memory.bandwidth_gb_s"] = {"confidence": "measured", "ref": ref + ", single-thread memcpy"}
        if memory:
            data["memory"] = memory
    data["description"] = f"{profile.description} (measured on {platform.node()}, {stamp})".strip()
    data["sources"] = sources
    header = "# Written by `sage transport probe --write`; edit freely, then: sage infer presets:validate FILE\n"
    return header + yaml.safe_dump(data, sort_keys=False)


def apply_transport_measurements(rec: TransportRecommendation, results: list[dict]) -> TransportRecommendation:
    """Pick the backend and chunk size that measured fastest here (`sage transport bench --json`
    results, lossless wire dtypes only) and say so in the reasons."""
    lossless = [r for r in results if r.get("dtype") in ("fp32", "fp16", "bf16")]
    if not lossless:
        return rec
    reasons = list(rec.reasons)
    for r in sorted(lossless, key=lambda r: (r["backend"], r["chunk_bytes"])):
        reasons.append(f"measured {r['backend']} with {human_bytes(r['chunk_bytes'])} chunks: {r['gbps']:.2f} GB/s "
                       f"({r['ratio_to_baseline']:.0%} of its raw baseline)")
    best = max(lossless, key=lambda r: r["gbps"])
    reasons.append(f"fastest measured: {best['backend']}, {human_bytes(best['chunk_bytes'])} chunks")
    config = rec.config.model_copy(update={"backend": best["backend"], "chunk_size": best["chunk_bytes"]})
    return TransportRecommendation(KVTransportConfig.model_validate(config.model_dump()), reasons)
