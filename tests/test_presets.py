"""The shipped presets (``presets/hardware``, ``presets/transport``) load, validate and
say where every number came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sage_infer.config.hardware import HardwareProfile, Vendor, numeric_leaf_paths
from sage_infer.config.presets import presets_dir
from sage_infer.config.transport import TransportPreset

PRESETS = presets_dir()
HARDWARE_FILES = sorted((PRESETS / "hardware").glob("*.yaml"))
TRANSPORT_FILES = sorted((PRESETS / "transport").glob("*.yaml"))

EXPECTED_HARDWARE = {
    "cpu",
    "nvidia-h100",
    "nvidia-h200",
    "ascend-910b",
    "cambricon-mlu590",
    "cambricon-mlu370-x8",
    "hygon-dcu-k100",
    "kunlunxin-p800",
}
EXPECTED_TRANSPORT = {"high-bw", "low-latency", "low-cost"}


def _load_hardware(path: Path) -> HardwareProfile:
    return HardwareProfile.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))


def _load_transport(path: Path) -> TransportPreset:
    return TransportPreset.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))


def test_expected_preset_files_exist() -> None:
    assert {p.stem for p in HARDWARE_FILES} >= EXPECTED_HARDWARE
    assert {p.stem for p in TRANSPORT_FILES} >= EXPECTED_TRANSPORT


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=lambda p: p.stem)
def test_hardware_preset_validates_and_is_named_after_its_file(path: Path) -> None:
    profile = _load_hardware(path)
    assert profile.name == path.stem


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=lambda p: p.stem)
def test_every_numeric_leaf_has_a_source(path: Path) -> None:
    profile = _load_hardware(path)
    leaves = numeric_leaf_paths(profile)
    assert leaves, "a hardware preset without numbers is not a preset"
    missing = [leaf for leaf in leaves if leaf not in profile.sources]
    assert not missing, f"{path.name}: numbers without a sources entry: {missing}"
    for leaf in leaves:
        assert profile.sources[leaf].ref.strip(), f"{path.name}: sources[{leaf!r}] has an empty ref"


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=lambda p: p.stem)
def test_default_kv_dtype_is_supported(path: Path) -> None:
    profile = _load_hardware(path)
    assert profile.kv.default_dtype in profile.kv.dtypes


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=lambda p: p.stem)
def test_accelerator_presets_name_the_devices_they_match(path: Path) -> None:
    profile = _load_hardware(path)
    if profile.vendor is Vendor.CPU:
        return
    assert profile.device.model_names, f"{path.name}: an accelerator preset needs model_names"
    assert all(name.strip() for name in profile.device.model_names)


def test_every_vendor_has_a_preset() -> None:
    vendors = {_load_hardware(path).vendor for path in HARDWARE_FILES}
    assert vendors == set(Vendor)


@pytest.mark.parametrize("path", TRANSPORT_FILES, ids=lambda p: p.stem)
def test_transport_preset_validates_and_is_named_after_its_file(path: Path) -> None:
    preset = _load_transport(path)
    assert preset.name == path.stem
    assert "chunk_size" in preset.values()


def test_transport_presets_differ_in_chunk_size() -> None:
    chunks = {path.stem: int(_load_transport(path).kv_transport.chunk_size) for path in TRANSPORT_FILES}
    assert len(set(chunks.values())) == len(chunks), f"chunk sizes collide: {chunks}"
