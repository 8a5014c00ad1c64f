"""Vendor topology parsers against sample outputs in tests/data/topology (see its README)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from sage_infer.hal.topology import (
    PARSERS,
    LinkClass,
    Topology,
    TopologyParseError,
    parse_cnmon_topo,
    parse_hy_smi_topo,
    parse_npu_smi_topo,
    parse_nvidia_smi_topo,
    parse_topology,
    parse_xpu_smi_topo,
)
from sage_infer.hal.topology.cnmon import classify_cambricon
from sage_infer.hal.topology.xpu_smi import classify_kunlunxin

DATA = Path(__file__).parent / "data" / "topology"
H100, PCIE2, DGX1, A2, A910, P310 = (
    "nvidia_smi_topo_dgx_h100.txt",
    "nvidia_smi_topo_pcie_2gpu.txt",
    "nvidia_smi_topo_dgx1v_legacy.txt",
    "npu_smi_topo_910b_hccs.txt",
    "npu_smi_topo_910a_two_hccs_groups.txt",
    "npu_smi_topo_310p_pcie.txt",
)
MLU_X8, MLU_S4, P800 = "cnmon_topo_mlu370_x8_short.txt", "cnmon_topo_mlu370_s4_words.txt", "xpu_smi_topo_p800_8x.txt"
HY8, MI210, MI300 = "hy_smi_showtopo_8dcu.json", "rocm_smi_showtopo_mi210_4gpu.json", "rocm_smi_showtopo_mi300x.txt"
VENDOR = {H100: "nvidia", PCIE2: "nvidia", DGX1: "nvidia", A2: "ascend", A910: "ascend", P310: "ascend"}
VENDOR |= {MLU_X8: "cambricon", MLU_S4: "cambricon", P800: "kunlunxin", HY8: "hygon", MI210: "hygon", MI300: "hygon"}
TOOL = {"nvidia": "nvidia-smi topo -m", "ascend": "npu-smi info -t topo", "cambricon": "cnmon topo -m"}
TOOL |= {"kunlunxin": "xpu-smi topo -m", "hygon": "hy-smi"}
SAMPLE_OF = {"nvidia": H100, "ascend": A2, "cambricon": MLU_X8, "kunlunxin": P800, "hygon": HY8}
L = LinkClass


@cache
def load(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


@cache
def topo(name: str) -> Topology:
    return parse_topology(VENDOR[name], load(name))


def cpus(*ranges: tuple[int, int]) -> list[int]:
    return [cpu for lo, hi in ranges for cpu in range(lo, hi + 1)]


def error_of(parser, text: object) -> str:
    with pytest.raises(TopologyParseError) as info:
        parser(text)
    assert "\n" not in str(info.value), "error message should be one line"
    return str(info.value)


# (sample, device count, device names, NIC names, link classes present)
SHAPES = [
    (H100, 8, [f"GPU{i}" for i in range(8)], [f"mlx5_{i}" for i in range(12)], {L.NVLINK}),
    (PCIE2, 2, ["GPU0", "GPU1"], ["mlx5_0", "mlx5_1"], {L.PCIE_SYS}),
    (DGX1, 8, [f"GPU{i}" for i in range(8)], [f"mlx5_{i}" for i in range(4)], {L.NVLINK, L.PCIE_SYS}),
    (A2, 8, [f"NPU{i}" for i in range(8)], [], {L.HCCS}),
    (A910, 8, [f"NPU{i}" for i in range(8)], [], {L.HCCS, L.PCIE_SYS}),
    (P310, 8, [f"NPU{i}" for i in range(8)], [], {L.PCIE_SWITCH, L.PCIE_HOST_BRIDGE, L.PCIE_SYS}),
    (MLU_X8, 16, [f"MLU{i}" for i in range(16)], [], {L.MLU_LINK, L.PCIE_SWITCH, L.PCIE_NUMA}),
    (MLU_S4, 8, [f"MLU{i}" for i in range(8)], [], {L.PCIE_SWITCH, L.PCIE_HOST_BRIDGE, L.PCIE_NUMA, L.PCIE_SYS}),
    (P800, 8, [f"XPU{i}" for i in range(8)], [f"mlx5_bond_{i}" for i in range(8)], {L.XPU_LINK, L.PCIE_SYS}),
    (HY8, 8, [f"card{i}" for i in range(8)], [], {L.XGMI, L.PCIE_SYS}),
    (MI210, 4, [f"card{i}" for i in range(4)], [], {L.XGMI, L.PCIE_NUMA, L.PCIE_SYS}),
    (MI300, 8, [f"GPU{i}" for i in range(8)], [], {L.XGMI}),
]


@pytest.mark.parametrize(("name", "count", "devices", "nics", "classes"), SHAPES)
def test_sample_devices_nics_and_one_link_per_pair(name, count, devices, nics, classes) -> None:
    t = topo(name)
    assert [d.name for d in t.devices] == devices and [d.index for d in t.devices] == list(range(count))
    assert [n.name for n in t.nics] == nics
    assert len(t.links) == count * (count - 1) // 2 and t.link_classes() == classes
    assert t.vendor == VENDOR[name] and json.loads(json.dumps(t.to_dict()))["vendor"] == VENDOR[name]


# (sample, a, b, class, raw label, lanes)
LINKS = [
    (H100, 6, 1, L.NVLINK, "NV18", 18),  # NV18 -> 18 bonded NVLinks, looked up in reverse order
    (PCIE2, 0, 1, L.PCIE_SYS, "SYS", None),
    (DGX1, 0, 1, L.NVLINK, "NV1", 1),
    (DGX1, 0, 3, L.NVLINK, "NV2", 2),
    (DGX1, 0, 5, L.PCIE_SYS, "SYS", None),
    (A2, 6, 1, L.HCCS, "HCCS", None),
    (A910, 3, 4, L.PCIE_SYS, "SYS", None),
    (P310, 0, 1, L.PCIE_SWITCH, "PIX", None),
    (P310, 0, 2, L.PCIE_HOST_BRIDGE, "PHB", None),
    (MLU_X8, 0, 5, L.MLU_LINK, "MLK", None),
    (MLU_X8, 10, 11, L.PCIE_SWITCH, "INT", None),  # two chips of one MLU370-X8 board
    (MLU_X8, 3, 12, L.PCIE_NUMA, "CPU", None),
    (MLU_S4, 0, 1, L.PCIE_SWITCH, "SINGLE SWITCH", None),
    (MLU_S4, 0, 2, L.PCIE_SWITCH, "MULTIPLE SWITCH", None),
    (MLU_S4, 4, 5, L.PCIE_HOST_BRIDGE, "HOST BRIDGE", None),
    (MLU_S4, 0, 7, L.PCIE_SYS, "SYSTEM", None),
    (P800, 0, 3, L.XPU_LINK, "XL", None),
    (P800, 3, 4, L.PCIE_SYS, "SYS", None),
    (HY8, 2, 1, L.XGMI, "XGMI", None),
    (HY8, 0, 4, L.PCIE_SYS, "PCIE", None),  # PCIe between different NUMA nodes
    (MI210, 0, 1, L.PCIE_NUMA, "PCIE", None),  # PCIe inside one NUMA node
    (MI210, 2, 3, L.XGMI, "XGMI", None),
    (MI300, 5, 7, L.XGMI, "XGMI", None),
]


@pytest.mark.parametrize(("name", "a", "b", "link_class", "label", "lanes"), LINKS)
def test_link_class_label_and_lanes_of_pair(name, a, b, link_class, label, lanes) -> None:
    link = topo(name).link(a, b)
    assert (link.a, link.b) == (min(a, b), max(a, b))
    assert (link.link_class, link.label, link.lanes) == (link_class, label, lanes)
    assert link.link_class.is_device_link == (link_class in {L.NVLINK, L.HCCS, L.MLU_LINK, L.XPU_LINK, L.XGMI})


# (sample, device index, CPU Affinity text, expanded CPUs, NUMA node)
DEVICES = [
    (H100, 0, "0-55,112-167", cpus((0, 55), (112, 167)), 0),
    (H100, 7, "56-111,168-223", cpus((56, 111), (168, 223)), 1),
    (PCIE2, 1, "32-63,96-127", cpus((32, 63), (96, 127)), 1),
    (DGX1, 4, "20-39,60-79", cpus((20, 39), (60, 79)), None),  # old layout: no NUMA column
    (A2, 2, "48-71", cpus((48, 71)), None),
    (MLU_S4, 5, "32-63,96-127", cpus((32, 63), (96, 127)), None),
    (P800, 5, "96-191,288-383", cpus((96, 191), (288, 383)), 1),
    (HY8, 6, None, [], 7),
    (MI300, 4, None, [], 1),
]


@pytest.mark.parametrize(("name", "index", "affinity", "expanded", "numa"), DEVICES)
def test_device_cpu_affinity_and_numa_node(name, index, affinity, expanded, numa) -> None:
    device = topo(name).devices[index]
    assert (device.index, device.cpu_affinity, device.cpus, device.numa_node) == (index, affinity, expanded, numa)


# (sample, NIC name, device index, class of the NIC-to-device path)
NICS = [
    (H100, "mlx5_0", 0, L.PCIE_SWITCH),  # PIX
    (H100, "mlx5_0", 1, L.PCIE_NUMA),  # NODE
    (H100, "mlx5_0", 4, L.PCIE_SYS),
    (H100, "mlx5_3", 1, L.PCIE_SWITCH),
    (PCIE2, "mlx5_0", 0, L.PCIE_HOST_BRIDGE),
    (DGX1, "mlx5_2", 4, L.PCIE_SWITCH),
    (DGX1, "mlx5_2", 6, L.PCIE_HOST_BRIDGE),
    (P800, "mlx5_bond_6", 6, L.PCIE_SWITCH),
    (P800, "mlx5_bond_6", 7, L.PCIE_HOST_BRIDGE),
    (P800, "mlx5_bond_6", 0, L.PCIE_SYS),
]


@pytest.mark.parametrize(("name", "nic", "device", "link_class"), NICS)
def test_nic_to_device_relation(name, nic, device, link_class) -> None:
    links = next(n for n in topo(name).nics if n.name == nic).device_links
    assert links[device] is link_class and sorted(links) == [d.index for d in topo(name).devices]


def test_link_lookup_is_symmetric_and_none_for_self_or_unknown_device() -> None:
    t = topo(H100)
    assert t.link(5, 2) is t.link(2, 5) is not None
    assert t.link(3, 3) is None and t.link(0, 99) is None


@pytest.mark.parametrize(
    "mangle",
    [
        lambda s: s.replace("GPU0", "\x1b[1mGPU0\x1b[0m").replace("NV18", "\x1b[32mNV18\x1b[0m"),  # ANSI colour
        lambda s: s.replace("\n", "\r\n"),  # CRLF
        lambda s: s.replace("\t", "    "),  # pasted with spaces instead of tabs
        lambda s: "root@node1:~# nvidia-smi topo -m\n" + s,  # shell prompt above the matrix
    ],
    ids=["ansi", "crlf", "spaces", "prompt"],
)
def test_nvidia_formatting_noise_does_not_change_result(mangle) -> None:
    assert parse_nvidia_smi_topo(mangle(load(H100))).to_dict() == topo(H100).to_dict()


@pytest.mark.parametrize(("label", "link_class"), [("SOC", L.PCIE_SYS), ("C2C", L.UNKNOWN)])
def test_nvidia_old_soc_and_unknown_labels(label: str, link_class: LinkClass) -> None:
    text = f"\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \t{label}\t0-7\nGPU1\t{label}\t X \t8-15\n"
    link = parse_nvidia_smi_topo(text).link(0, 1)
    assert (link.link_class, link.label) == (link_class, label)


def test_ascend_sio_ub_na_labels_and_header_at_column_zero() -> None:
    text = "NPU0  NPU1  NPU2  CPU Affinity\nNPU0  X  SIO  NA  0-23\nNPU1  SIO  X  UB  0-23\nNPU2  NA  UB  X  24-47\n"
    t = parse_npu_smi_topo(text)
    assert [t.link(0, 1).link_class, t.link(1, 2).link_class, t.link(0, 2).link_class] == [L.HCCS, L.HCCS, L.UNKNOWN]


@pytest.mark.parametrize(
    ("label", "expected"),
    [("MLU-Link", (L.MLU_LINK, None)), ("MLU Link", (L.MLU_LINK, None)), ("MUL/MLK", (L.MLU_LINK, None)),
     ("MLK4", (L.MLU_LINK, 4)), ("hostbridge", (L.PCIE_HOST_BRIDGE, None)), ("HOB", (L.PCIE_HOST_BRIDGE, None)),
     ("SIN", (L.PCIE_SWITCH, None)), ("SELF", (L.SELF, None)), ("???", (L.UNKNOWN, None))],
)  # fmt: skip
def test_cnmon_classifier_accepts_short_labels_and_relation_words(label: str, expected: tuple) -> None:
    assert classify_cambricon(label) == expected


def test_xpu_link_spelled_out_is_one_cell_and_lane_suffix_is_read() -> None:
    link = parse_xpu_smi_topo(load(P800).replace("\tXL\t", "\tXPU Link\t")).link(1, 2)
    assert (link.link_class, link.label) == (L.XPU_LINK, "XPU Link")
    assert classify_kunlunxin("XL2") == (L.XPU_LINK, 2)


def test_hy_smi_pairs_only_json_infers_devices_and_negative_numa_is_unknown() -> None:
    pair = "(Topology) Link type between DRM devices 0 and 1"
    t = parse_hy_smi_topo(json.dumps({"card0": {"(Topology) Numa Node": "-1"}, "system": {pair: "PCIE"}}))
    assert [(d.name, d.numa_node) for d in t.devices] == [("card0", None), ("card1", None)]
    assert t.link(0, 1).link_class is L.PCIE_SYS


def test_hy_smi_warning_line_before_json_is_skipped() -> None:
    assert len(parse_hy_smi_topo("WARNING: running in a container\n" + load(MI210)).devices) == 4


def test_registry_and_dispatch() -> None:
    assert PARSERS == {"nvidia": parse_nvidia_smi_topo, "ascend": parse_npu_smi_topo, "cambricon": parse_cnmon_topo,
                       "hygon": parse_hy_smi_topo, "kunlunxin": parse_xpu_smi_topo}  # fmt: skip
    assert parse_topology(" Ascend ", load(A2)).vendor == "ascend"


def test_unknown_vendor_is_rejected_with_the_known_ones() -> None:
    message = error_of(lambda text: parse_topology("intel", text), load(PCIE2))
    assert message.startswith("unknown topology vendor 'intel'; expected one of ascend, cambricon, hygon")


@pytest.mark.parametrize("vendor", sorted(PARSERS))
@pytest.mark.parametrize(
    ("text", "expected"),
    [("", "empty input"), (" \n\t\n", "empty input"), ("Segmentation fault\nmore noise\n", "expected"),
     (None, "expected the command's text output")],
)  # fmt: skip
def test_empty_garbage_or_non_text_input_is_rejected(vendor: str, text: object, expected: str) -> None:
    message = error_of(PARSERS[vendor], text)
    assert expected in message and TOOL[vendor] in message


@pytest.mark.parametrize("vendor", sorted(PARSERS))
def test_output_truncated_mid_matrix_is_rejected(vendor: str) -> None:
    text = load(SAMPLE_OF[vendor])
    message = error_of(PARSERS[vendor], text[: len(text) // 3])
    assert "truncated" in message or "invalid JSON" in message


GPU7_TAIL = "PIX\t56-111,168-223\t1\t\tN/A\nNIC0"  # GPU7's last link cell and its attribute columns


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        (parse_nvidia_smi_topo, "\n".join(x for x in load(H100).split("\n") if x[:5] != "GPU3\t"), "missing GPU3"),
        (parse_npu_smi_topo, load(A2).replace("NPU2       HCCS       HCCS       X", "NPU2       HCCS"), "row NPU2 has"),
        (parse_nvidia_smi_topo, load(H100)[: load(H100).index(GPU7_TAIL) + len("PIX")], "ends inside row GPU7"),
        (parse_nvidia_smi_topo, load(H100).replace("0-55,", "0-55,x", 1), "GPU0 has an unreadable CPU Affinity"),
        (parse_xpu_smi_topo, "XPU0 XPU0 CPU Affinity\nXPU0 X X 0-3\n", "duplicate column"),
        (parse_hy_smi_topo, "[1, 2]", "top-level JSON is list"),
        (parse_hy_smi_topo, '{"foo": "bar"}', "no devices found"),
        (parse_hy_smi_topo, '{"card0": {"(Topology) Numa Node": "0"', "no JSON object"),
    ],
    ids=["no-row", "short-row", "cut-last-row", "bad-cpus", "dup-column", "json-list", "json-no-topo", "json-cut"],
)
def test_specific_defects_are_named_in_the_error(parser, text: str, expected: str) -> None:
    assert expected in error_of(parser, text)


@pytest.mark.parametrize("name", sorted(VENDOR))
def test_truncation_anywhere_never_raises_anything_but_parse_error(name: str) -> None:
    text, parser = load(name), PARSERS[VENDOR[name]]
    for cut in sorted(set(range(0, len(text), 7)) | {i for i, ch in enumerate(text) if ch == "\n"}):
        try:
            assert isinstance(parser(text[:cut]), Topology)
        except TopologyParseError:
            pass
