"""Device detection reads /sys, /proc and vendor tools; every piece is tested on
captured or constructed inputs, and the real probe runs on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sage_infer.config.recommend import annotate_link_bandwidths, match_preset, recommend_transport
from sage_infer.hal import detect
from sage_infer.hal.cpu import CpuInfo, NumaNode, _compact, read_cpu_model, read_numa_nodes
from sage_infer.hal.detect import HardwareReport, detect_devices, probe_vendor
from sage_infer.hal.topology.model import Link, LinkClass, Topology
from sage_infer.hal.vendors import kunlunxin
from sage_infer.hal.vendors.common import VendorReport
from sage_infer.hal.vendors.nvidia import kv_dtypes_for_capability, parse_query_gpu
from sage_infer.interfaces import AcceleratorDescriptor, KVDtype

CPUINFO = """\
processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 1

processor\t: 2
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 1
core id\t\t: 0

processor\t: 3
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 1
core id\t\t: 0
"""

QUERY_GPU = """\
0, NVIDIA H100 80GB HBM3, 81559, 550.54.15
1, NVIDIA H100 80GB HBM3, 81559, 550.54.15
"""


def _fake_numa(root: Path) -> Path:
    for node, cpus, kb in [(0, "0-55,112-167", 1056546432), (1, "56-111,168-223", 1056954368)]:
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree: 1 kB\n")
    (root / "possible").write_text("0-1\n")
    return root


def test_numa_nodes_from_sysfs(tmp_path):
    nodes = read_numa_nodes(_fake_numa(tmp_path / "node"))
    assert [n.node for n in nodes] == [0, 1]
    assert len(nodes[0].cpus) == 112 and nodes[0].cpus[56] == 112
    assert nodes[1].memory_bytes == 1056954368 * 1024


def test_numa_nodes_missing_sysfs_is_empty(tmp_path):
    assert read_numa_nodes(tmp_path / "absent") == []


def test_cpu_model_counts_physical_cores_and_sockets(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert read_cpu_model(path) == ("Intel(R) Xeon(R) Platinum 8480+", 3, 2)


def test_cpu_list_compaction_round_trips():
    assert _compact([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _compact([]) == ""


def test_real_cpu_probe_on_this_machine():
    report = detect_devices(measure=True)
    assert report.cpu.logical_cores >= 1
    assert report.cpu.memcpy_gb_s and report.cpu.memcpy_gb_s > 0
    assert report.primary_vendor in ("cpu", "nvidia", "hygon", "ascend", "cambricon", "kunlunxin")
    for vendor in report.vendors:
        assert vendor.available or vendor.reason


def test_nvidia_smi_query_parses_devices():
    devices = parse_query_gpu(QUERY_GPU)
    assert [d.index for d in devices] == [0, 1]
    assert devices[0].name == "NVIDIA H100 80GB HBM3"
    assert devices[0].memory_bytes == 81559 * 1024 * 1024
    assert devices[1].driver_version == "550.54.15" and devices[1].torch_device == "cuda:1"


def test_nvidia_fp8_kv_needs_ada_or_hopper():
    assert KVDtype.FP8_E4M3 in kv_dtypes_for_capability(9, 0)
    assert KVDtype.FP8_E4M3 not in kv_dtypes_for_capability(8, 0)
    assert KVDtype.BF16 not in kv_dtypes_for_capability(7, 0)


def test_kunlunxin_found_by_pci_vendor_id(tmp_path):
    for address, vendor in [("0000:17:00.0", "0x1d22"), ("0000:18:00.0", "0x10de"), ("0000:3b:00.0", "0x1d22")]:
        d = tmp_path / address
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
    assert kunlunxin.scan_pci(tmp_path) == ["0000:17:00.0", "0000:3b:00.0"]
    report = kunlunxin.probe(pci_root=tmp_path)
    assert report.available and [d.torch_device for d in report.devices] == ["cuda:0", "cuda:1"]


def test_kunlunxin_absent_says_why(tmp_path):
    report = kunlunxin.probe(pci_root=tmp_path)
    assert not report.available and "0x1d22" in report.reason


def test_a_crashing_vendor_probe_becomes_a_reason(monkeypatch):
    monkeypatch.setitem(detect.VENDOR_PROBES, "nvidia", "sage_infer.hal.vendors.does_not_exist")
    report = probe_vendor("nvidia")
    assert not report.available and "ModuleNotFoundError" in report.reason


def _report(vendor: str, names: list[str], links: list[Link] | None = None, memcpy: float | None = None):
    cpu = CpuInfo("test cpu", 8, 4, 1, 64 << 30, [NumaNode(0, list(range(8)))], memcpy)
    devices = [AcceleratorDescriptor(vendor, "cuda", i, n, 80 << 30, (KVDtype.BF16,)) for i, n in enumerate(names)]
    topology = Topology(vendor, "test", links=links or []) if links is not None else None
    vendors = [VendorReport(vendor, bool(devices), None if devices else "none", devices, topology)]
    return HardwareReport(cpu, vendors)


@pytest.mark.parametrize(
    "vendor,name,preset",
    [
        ("nvidia", "NVIDIA H200", "nvidia-h200"),
        ("nvidia", "NVIDIA H100 80GB HBM3", "nvidia-h100"),
        ("ascend", "Ascend910B3", "ascend-910b"),
        ("hygon", "K100_AI", "hygon-dcu-k100"),
    ],
)
def test_match_preset_by_device_name(vendor, name, preset):
    assert match_preset(_report(vendor, [name])) == preset


def test_match_preset_without_accelerators_is_cpu():
    assert match_preset(_report("nvidia", [])) == "cpu"


def test_nvlink_machine_gets_high_bandwidth_transport():
    links = [Link(0, 1, LinkClass.NVLINK, "NV18", 18)]
    rec = recommend_transport(_report("nvidia", ["NVIDIA H100 80GB HBM3"] * 2, links), "nvidia-h100")
    assert rec.config.preset == "high-bw" and rec.config.backend == "torchdist"
    assert int(rec.config.chunk_size) == 16 << 20
    assert any("nvlink" in reason for reason in rec.reasons)


def test_cpu_machine_gets_shm_with_chunks_sized_to_bandwidth():
    rec = recommend_transport(_report("nvidia", [], memcpy=10.0), "cpu")
    assert rec.config.backend == "shm"
    assert int(rec.config.chunk_size) == 8 << 20  # 10 GB/s x 1 ms = 10 MB -> 8 MiB
    assert "--kv-transport backend=shm" in rec.flags()
    assert "--kv-transport chunk-size=8MiB" in rec.flags()


QUERY_GPU_8X = "".join(f"{i}, NVIDIA H100 80GB HBM3, 81559, 550.54.15\n" for i in range(8))


def _fake_tool(bin_dir: Path, name: str, outputs: dict[str, Path]) -> None:
    """A shell script standing in for a vendor tool: prints a captured sample per argv."""
    bin_dir.mkdir(exist_ok=True)
    cases = "\n".join(f'  "{args}") cat "{path}" ;;' for args, path in outputs.items())
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}\n  *) exit 3 ;;\nesac\n')
    script.chmod(0o755)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


TOPO = Path(__file__).parent / "data" / "topology"


def test_nvidia_probe_through_nvidia_smi_samples(fake_bin, tmp_path):
    query = tmp_path / "query.csv"
    query.write_text(QUERY_GPU_8X)
    _fake_tool(fake_bin, "nvidia-smi", {
        "--query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits": query,
        "topo -m": TOPO / "nvidia_smi_topo_dgx_h100.txt",
    })
    import torch

    if torch.cuda.is_available():
        pytest.skip("a real GPU is present; the nvidia-smi fallback path is not taken")
    report = probe_vendor("nvidia")
    assert report.available and len(report.devices) == 8
    assert report.topology is not None and report.topology.link(0, 7).link_class is LinkClass.NVLINK
    hardware = HardwareReport(detect_devices(measure=False).cpu, [report])
    assert match_preset(hardware) == "nvidia-h100"
    assert recommend_transport(hardware, "nvidia-h100").config.preset == "high-bw"
    annotate_link_bandwidths(hardware, "nvidia-h100")
    assert report.topology.link(0, 7).bandwidth_gb_s == 18 * 25  # NV18 x 25 GB/s per link per direction


def test_ascend_probe_reads_topology_without_torch_npu(fake_bin):
    _fake_tool(fake_bin, "npu-smi", {"info -t topo": TOPO / "npu_smi_topo_910b_hccs.txt"})
    report = probe_vendor("ascend")
    assert not report.available and "torch_npu is not installed" in report.reason
    assert report.tools == {"npu-smi": True}
    assert report.topology is not None and LinkClass.HCCS in report.topology.link_classes()


def test_garbled_tool_output_is_a_reason_not_a_crash(fake_bin, tmp_path):
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("NVRM: API mismatch\n")
    query = tmp_path / "query.csv"
    query.write_text(QUERY_GPU_8X)
    _fake_tool(fake_bin, "nvidia-smi", {
        "--query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits": query,
        "topo -m": garbage,
    })
    import torch

    if torch.cuda.is_available():
        pytest.skip("a real GPU is present")
    report = probe_vendor("nvidia")
    assert report.available and report.topology is None
    assert "topology output not understood" in report.reason


def test_torch_plugin_probe_lists_plugin_devices(tmp_path, monkeypatch):
    """The plugin path as torch_npu would drive it; the plugin itself cannot run here, so a
    stand-in module registers a device API on torch the way torch_npu registers torch.npu."""
    import sys

    import torch

    from sage_infer.hal.vendors.common import probe_torch_plugin

    (tmp_path / "fake_npu_plugin.py").write_text(
        "import types, torch\n"
        "torch.fakenpu = types.SimpleNamespace(device_count=lambda: 2,\n"
        "    get_device_name=lambda i: 'Ascend910B3',\n"
        "    get_device_properties=lambda i: types.SimpleNamespace(total_memory=64 * 2**30))\n"
        "__version__ = '2.1.0.post8'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        report = probe_torch_plugin("ascend", "fake_npu_plugin", "fakenpu", ["npu-smi", "info"], (KVDtype.BF16,))
    finally:
        monkeypatch.delattr(torch, "fakenpu", raising=False)
        sys.modules.pop("fake_npu_plugin", None)
    assert report.available and report.torch_module == "fake_npu_plugin 2.1.0.post8"
    assert [d.torch_device for d in report.devices] == ["fakenpu:0", "fakenpu:1"]
    assert report.tools == {"npu-smi": False}
    assert match_preset(HardwareReport(detect_devices(measure=False).cpu, [report])) == "ascend-910b"


def test_torch_plugin_that_fails_to_load_is_a_reason(tmp_path, monkeypatch):
    from sage_infer.hal.vendors.common import probe_torch_plugin

    (tmp_path / "broken_plugin.py").write_text("raise OSError('libascendcl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = probe_torch_plugin("ascend", "broken_plugin", "npu", ["npu-smi", "info"], (KVDtype.BF16,))
    assert not report.available and "libascendcl.so" in report.reason


# --- hal/device.py: a preset's device type becomes a torch device, or one line --------


def test_select_device_cpu_needs_nothing():
    import torch

    from sage_infer.hal.device import select_device

    assert select_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_select_device_maps_to_device_zero_when_present(monkeypatch, device_type):
    # no such hardware here: pretend torch sees one device of the type
    import torch

    from sage_infer.hal.device import select_device

    backend = getattr(torch, device_type)
    monkeypatch.setattr(backend, "is_available", lambda: True)
    monkeypatch.setattr(backend, "device_count", lambda: 1)
    assert select_device(device_type) == torch.device(device_type, 0)


def test_hygon_and_kunlunxin_presets_are_torch_cuda(monkeypatch):
    import sys
    import types

    import torch

    from sage_infer.config.auto import resolve_device
    from sage_infer.config.resolve import resolve_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setitem(sys.modules, "torch_xmlir", types.ModuleType("torch_xmlir"))  # Kunlunxin's plugin
    for preset in ("hygon-dcu-k100", "kunlunxin-p800", "nvidia-h100"):
        device = resolve_device(resolve_config(preset=preset, env={}).config)
        assert device.value == torch.device("cuda", 0), preset


@pytest.mark.parametrize(("preset", "line"), [
    ("ascend-910b", "preset ascend-910b needs torch_npu (Ascend NPU): not installed"),
    ("cambricon-mlu590", "preset cambricon-mlu590 needs torch_mlu (Cambricon MLU): not installed"),
    ("kunlunxin-p800", "preset kunlunxin-p800 needs torch_xmlir (Kunlunxin XPU): not installed"),
])
def test_missing_vendor_plugin_is_one_line(monkeypatch, preset, line):
    import builtins

    from sage_infer.config.auto import resolve_device
    from sage_infer.config.resolve import resolve_config
    from sage_infer.errors import ConfigError

    real_import = builtins.__import__

    def no_vendor_plugins(name, *args, **kwargs):  # even where a plugin happens to be installed
        if name.split(".")[0] in ("torch_npu", "torch_mlu", "torch_xmlir"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vendor_plugins)
    with pytest.raises(ConfigError) as err:
        resolve_device(resolve_config(preset=preset, env={}).config)
    assert str(err.value) == line and err.value.exit_code == 2


def test_plugin_without_a_device_is_one_line(monkeypatch):
    import sys
    import types

    from sage_infer.hal.device import DeviceNotAvailableError, select_device

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # installed, registers nothing
    with pytest.raises(DeviceNotAvailableError) as err:
        select_device("npu", "torch_npu", requested_by="preset ascend-910b", vendor="ascend")
    assert str(err.value) == ("preset ascend-910b needs torch device 'npu' (Ascend NPU): "
                              "torch_npu is installed but sees no device")


def test_cuda_preset_on_a_cpu_torch_is_one_line(monkeypatch):
    import torch

    from sage_infer.hal.device import DeviceNotAvailableError, select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceNotAvailableError, match=r"^preset nvidia-h100 needs torch device 'cuda' \(NVIDIA GPU\)"):
        select_device("cuda", "torch.cuda", requested_by="preset nvidia-h100", vendor="nvidia")


def test_unknown_device_type_is_one_line():
    from sage_infer.hal.device import DeviceNotAvailableError, select_device

    with pytest.raises(DeviceNotAvailableError, match="asks for torch device type 'tpu', which sage_infer does not"):
        select_device("tpu", requested_by="preset mine")


def test_cpu_bf16_fact_comes_from_cpu_flags(tmp_path, monkeypatch):
    import torch

    from sage_infer.hal import device as hal_device

    flags = tmp_path / "cpuinfo"
    flags.write_text("flags\t\t: fpu sse2 avx512f avx512_bf16\n")
    read_flags = hal_device._cpu_flags
    monkeypatch.setattr(hal_device, "_cpu_flags", lambda: read_flags(str(flags)))
    assert hal_device.device_facts(torch.device("cpu")).native_bf16 is True
    flags.write_text("flags\t\t: fpu sse2 avx2\n")
    assert hal_device.device_facts(torch.device("cpu")).native_bf16 is False


def test_hal_is_below_config():
    """hal imports sage_infer.core, .errors and .interfaces (contracts on core) only: never config."""
    import ast

    hal = Path(__file__).resolve().parents[1] / "sage_infer" / "hal"
    allowed = ("sage_infer.hal", "sage_infer.core", "sage_infer.errors", "sage_infer.interfaces")
    for path in hal.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("sage_infer"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"
