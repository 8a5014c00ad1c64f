"""`sage compress ...`: write quantized or pruned copies of a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sage_infer.cli.options import JsonOpt
from sage_infer.cli.output import emit, table

app = typer.Typer(help="Quantize or prune a model checkpoint.", no_args_is_help=True)


@app.callback()
def _compress() -> None:
    """Quantize or prune a model checkpoint."""


# -- quantize ------------------------------------------------------------------------------

SCHEMES = {"w8a16": 8, "w4a16": 4}
DEFAULT_GROUP = {"w8a16": "channel", "w4a16": "128"}


@app.command("quantize")
def quantize_command(
    model: Annotated[Path, typer.Argument(help="Hugging Face model directory to quantize.")],
    out: Annotated[Path, typer.Argument(help="Directory to write the quantized copy to (new or empty).")],
    scheme: Annotated[str, typer.Option("--scheme", help="w8a16 (int8 weights) or w4a16 (int4 weights); "
                                        "activations stay in the model's dtype.")] = "w4a16",
    group_size: Annotated[Optional[str], typer.Option(
        "--group-size", help="Input columns per scale: 32, 64, 128, 256 or channel (one per output channel). "
        "Default: channel for w8a16, 128 for w4a16.")] = None,
    asymmetric: Annotated[bool, typer.Option("--asymmetric", help="Zero points per group (min/max range) "
                                             "instead of symmetric scales.")] = False,
    method: Annotated[str, typer.Option("--method", help="rtn (round to nearest) or gptq (error "
                                        "compensation on calibration text).")] = "rtn",
    calib_samples: Annotated[Optional[int], typer.Option("--calib-samples", help="gptq: calibration windows "
                                                         "(default 64).")] = None,
    calib_seq_len: Annotated[Optional[int], typer.Option("--calib-seq-len", help="gptq: tokens per calibration "
                                                         "window (default 256).")] = None,
    calib_file: Annotated[
        Optional[Path], typer.Option("--calib-file", help="gptq: UTF-8 text to calibrate on instead of the "
                                     "Shakespeare train split.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a weight-only quantized copy of MODEL to OUT in the compressed-tensors format (loads in sage
    and vLLM). Decoder linears are quantized; embeddings, norms and lm_head are kept."""
    from sage_infer.errors import UsageError
    from sage_infer.quantization.checkpoint import quantize_checkpoint
    from sage_infer.quantization.weights import WeightScheme

    if scheme not in SCHEMES:
        raise UsageError(f"--scheme {scheme}: expected one of {', '.join(SCHEMES)}")
    if method not in ("rtn", "gptq"):
        raise UsageError(f"--method {method}: expected rtn or gptq")
    group_text = group_size or DEFAULT_GROUP[scheme]
    if group_text == "channel":
        group = None
    elif group_text in ("32", "64", "128", "256"):
        group = int(group_text)
    else:
        raise UsageError(f"--group-size {group_text}: expected 32, 64, 128, 256 or channel")
    if not (model / "config.json").is_file():
        raise UsageError(f"{model}: not a Hugging Face model directory (no config.json)")
    weight_scheme = WeightScheme(SCHEMES[scheme], group, symmetric=not asymmetric)
    if method == "rtn" and (calib_file, calib_samples, calib_seq_len) != (None, None, None):
        raise UsageError("--calib-samples, --calib-seq-len and --calib-file apply to --method gptq only")
    quantizer, calibration_tokens = None, 0
    if method == "gptq":
        from sage_infer.quantization.calibration import read_calibration_file
        from sage_infer.quantization.checkpoint import check_shapes, has_experts
        from sage_infer.quantization.gptq import gptq_quantizer

        if has_experts(model):
            raise UsageError(f"--method gptq: {model} has mixture-of-experts experts; GPTQ for them is not "
                             f"implemented yet (--method rtn quantizes them)")
        check_shapes(model, weight_scheme)  # before the calibration pass, not after it
        texts = read_calibration_file(calib_file) if calib_file is not None else None
        quantizer, calibration_tokens = gptq_quantizer(model, weight_scheme, calib_samples or 64,
                                                       calib_seq_len or 256, texts)
    report = quantize_checkpoint(model, out, weight_scheme, method, quantizer)
    data = {"out": report.out_dir, "scheme": report.scheme, "method": report.method,
            "quantized_layers": report.quantized_layers, "kept_tensors": report.kept_tensors,
            "bytes_before": report.bytes_before, "bytes_after": report.bytes_after,
            "calibration_tokens": calibration_tokens, "files": report.files}

    def render(console) -> None:
        rows = [[key, str(value)] for key, value in data.items() if key != "files"]
        console.print(table("quantized checkpoint", ["field", "value"], rows))

    emit(data, as_json, render)



# -- prune ---------------------------------------------------------------------------------


@app.command("prune")
def prune_command(
    model: Annotated[
        Path, typer.Argument(help="Hugging Face model directory to prune (Llama, Mistral, Qwen2, Qwen3).")
    ],
    out: Annotated[Path, typer.Argument(help="Directory to write the pruned model to (new or empty).")],
    ffn: Annotated[
        Optional[str], typer.Option("--ffn", help="FFN channels to remove from every layer: a share (25%) or a "
                                    "count (128).")
    ] = None,
    heads: Annotated[
        int, typer.Option("--heads", help="KV groups to remove from every layer: each is one KV head with the "
                          "query heads that read it (GQA ratio kept).")
    ] = 0,
    calib_samples: Annotated[int, typer.Option("--calib-samples", help="Calibration windows.")] = 64,
    calib_seq_len: Annotated[int, typer.Option("--calib-seq-len", help="Tokens per calibration window.")] = 256,
    calib_file: Annotated[
        Optional[Path], typer.Option("--calib-file", help="UTF-8 text to calibrate on instead of the Shakespeare "
                                     "train split.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove the least important FFN channels and KV groups of heads, scored on calibration text."""
    from sage_infer.pruning.structured import PruneSpec, prune_checkpoint

    spec = PruneSpec(ffn=ffn, heads=heads, calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                     calib_file=calib_file)
    report = prune_checkpoint(model, out, spec).to_dict()

    def render(console) -> None:
        rows = [[key, f"{report[key][0]:,}", f"{report[key][1]:,}"]
                for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "params")]
        console.print(table(f"pruned -> {report['out']}", ["", "before", "after"], rows))
        console.print(f"calibration: {report['calibration_tokens']:,} tokens of {report['calibration']}; "
                      f"{report['seconds']} s")

    emit(report, as_json, render)
