"""compressed-tensors itself, as the oracle for sage's checkpoint format. Runs in the vLLM venv
(`.vllm-venv/bin/python tests/ct_oracle.py JOBS.json`), never imports sage_infer.

JOBS.json is a list of jobs, run in order in one process:
    {"op": "decompress", "ckpt": CKPT, "out": OUT}
        load CKPT with transformers + compressed-tensors (run_compressed=False: the library unpacks
        and dequantizes every layer) and save every Linear's dequantized weight to the safetensors OUT
    {"op": "compress", "src": SRC, "out": OUT, "bits": B, "group_size": G or null, "symmetric": bool}
        quantize SRC's Linear layers (not lm_head) with the library's min-max scales
        (calculate_qparams) and save a compressed checkpoint to OUT the way llmcompressor does
        (ModelCompressor.compress_model, update_config)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch


def decompress(ckpt: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype="auto")
    weights = {f"{name}.weight": module.weight.detach().contiguous()
               for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    save_file(weights, str(out))


def compress(src: Path, out: Path, bits: int, group_size: int | None, symmetric: bool) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            weight = module.weight
            group = group_size or weight.shape[1]
            grouped = weight.view(weight.shape[0], -1, group)
            scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def main() -> None:
    for job in json.loads(Path(sys.argv[1]).read_text()):
        if job["op"] == "decompress":
            decompress(Path(job["ckpt"]), Path(job["out"]))
        else:
            compress(Path(job["src"]), Path(job["out"]), job["bits"], job["group_size"], job["symmetric"])


if __name__ == "__main__":
    main()
