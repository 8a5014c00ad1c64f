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
