"""sage's compressed-tensors checkpoints against the real library (compressed-tensors 0.17 in the vLLM
venv, run as a subprocess by tests/ct_oracle.py): what sage writes the library decompresses to
exactly the weights sage runs, and what the library writes sage loads to exactly the library's
weights. Skipped without the venv (``make vllm-venv``, or VLLM_VENV=/path/to/venv)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sage_infer.layers.quant_linear import QuantLinear
from sage_infer.models.loader import DEMO_MODEL_DIR, load_model
from sage_infer.quantization.checkpoint import quantize_checkpoint
from sage_infer.quantization.weights import WeightScheme

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VLLM_VENV", REPO / ".vllm-venv"))
PYTHON = VENV / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv with compressed-tensors at {VENV} "
                       "(make vllm-venv, or set VLLM_VENV)"),
]

SCHEMES = {"w8-channel": WeightScheme(8), "w4-g32": WeightScheme(4, 32), "w4-g64-asym": WeightScheme(4, 64, False)}


def run_oracle(jobs: list[dict], tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(jobs))
    done = subprocess.run([str(PYTHON), str(REPO / "tests" / "ct_oracle.py"), str(path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def sage_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every quantized linear's weight as sage's reference path computes it."""
    model, _, _ = load_model(ckpt)
    return {f"{name}.weight": module.quantized.dequantize() for name, module in model.named_modules()
            if isinstance(module, QuantLinear)}


def assert_same_weights(sage: dict[str, torch.Tensor], library: dict[str, torch.Tensor]) -> None:
    library = {name: w for name, w in library.items() if name != "lm_head.weight"}  # tied to the embeddings
    assert sorted(sage) == sorted(library) and len(sage) == 28
    for name, weight in sage.items():
        assert weight.dtype == library[name].dtype, name
        assert torch.equal(weight, library[name]), name


def test_what_sage_writes_the_library_decompresses_to_sages_weights(tmp_path):
    for name, scheme in SCHEMES.items():
        quantize_checkpoint(DEMO_MODEL_DIR, tmp_path / name, scheme)
    run_oracle([{"op": "decompress", "ckpt": str(tmp_path / name), "out": str(tmp_path / f"{name}.lib.safetensors")}
                for name in SCHEMES], tmp_path)
    for name in SCHEMES:
        assert_same_weights(sage_weights(tmp_path / name), load_file(str(tmp_path / f"{name}.lib.safetensors")))


def test_what_the_library_writes_sage_loads_to_the_librarys_weights(tmp_path):
    jobs = []
    for name, scheme in SCHEMES.items():
        jobs.append({"op": "compress", "src": str(DEMO_MODEL_DIR), "out": str(tmp_path / name),
                     "bits": scheme.num_bits, "group_size": scheme.group_size, "symmetric": scheme.symmetric})
        jobs.append({"op": "decompress", "ckpt": str(tmp_path / name),
                     "out": str(tmp_path / f"{name}.lib.safetensors")})
    run_oracle(jobs, tmp_path)
    for name, scheme in SCHEMES.items():
        config = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        assert config["format"] == "pack-quantized"  # the library's choice for weight-only int8 too
        assert_same_weights(sage_weights(tmp_path / name), load_file(str(tmp_path / f"{name}.lib.safetensors")))
        sage_copy = tmp_path / f"{name}.sage"
        quantize_checkpoint(DEMO_MODEL_DIR, sage_copy, scheme)
        ours, theirs = (load_file(str(d / "model.safetensors")) for d in (sage_copy, tmp_path / name))
        assert sorted(ours) == sorted(theirs)
        assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
