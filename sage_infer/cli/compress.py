"""`sage compress ...`: write quantized or pruned copies of a Hugging Face model directory."""

from __future__ import annotations

import typer

app = typer.Typer(help="Quantize or prune a model checkpoint.", no_args_is_help=True)


@app.callback()
def _compress() -> None:
    """Quantize or prune a model checkpoint."""


# -- quantize ------------------------------------------------------------------------------


# -- prune ---------------------------------------------------------------------------------
