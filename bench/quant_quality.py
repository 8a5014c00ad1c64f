"""Held-out perplexity of the demo model quantized with RTN and with GPTQ, against the bf16 original.

    python bench/quant_quality.py --json out/quant_quality.json

Each scheme is written with `sage compress quantize` (the library functions behind it) to a temporary
directory, loaded by sage's loader, and its dequantized linear weights (what the reference path
multiplies by) are put into the `transformers` model, whose perplexity on the demo model's held-out
windows (`heldout_windows(tok, 48, 256)`, the demo model's recorded validation windows) is measured
in fp32. GPTQ calibrates on `--calib-samples` windows of 256 tokens of the train split.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SCHEMES = {"w8a16": (8, None), "w4a16-g64": (4, 64), "w4a16-g32": (4, 32), "w4a16-g32-asym": (4, 32, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import transformers

    from sage_infer.layers.quant_linear import QuantLinear
    from sage_infer.models.loader import DEMO_MODEL_DIR, load_model
    from sage_infer.quantization.calibration import heldout_windows, perplexity
    from sage_infer.quantization.checkpoint import quantize_checkpoint
    from sage_infer.quantization.gptq import gptq_quantizer
    from sage_infer.quantization.weights import WeightScheme

    torch.set_num_threads(args.threads)
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    windows = heldout_windows(tok, 48, 256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    rows = [{"scheme": "bf16", "method": "-", "perplexity": perplexity(hf, windows), "seconds": 0.0}]
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in SCHEMES.items():
            scheme = WeightScheme(*spec)
            for method in ("rtn", "gptq"):
                start = time.perf_counter()
                quantizer = None
                if method == "gptq":
                    quantizer, _ = gptq_quantizer(DEMO_MODEL_DIR, scheme, args.calib_samples, 256)
                out = Path(tmp) / f"{name}-{method}"
                quantize_checkpoint(DEMO_MODEL_DIR, out, scheme, method, quantizer)
                seconds = time.perf_counter() - start
                model, _, _ = load_model(out)
                hf.load_state_dict(original)
                with torch.no_grad():
                    for module_name, module in model.named_modules():
                        if isinstance(module, QuantLinear):
                            hf.get_submodule(module_name).weight.copy_(module.quantized.dequantize().float())
                rows.append({"scheme": name, "method": method, "perplexity": perplexity(hf, windows),
                             "seconds": seconds})
                print(f"  {name} {method} {rows[-1]['perplexity']:.2f}", file=sys.stderr)
    print(f"\ndemo model, held-out perplexity (48 x 256 tokens, fp32 math on the dequantized weights); GPTQ "
          f"calibrated on {args.calib_samples} x 256 train tokens")
    print("| scheme | method | perplexity | vs bf16 | quantize s |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['method']} | {r['perplexity']:.2f} | {r['perplexity'] / rows[0]['perplexity']:.3f}"
              f" | {r['seconds']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"calib_samples": args.calib_samples, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
