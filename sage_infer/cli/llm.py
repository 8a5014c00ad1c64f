"""`sage llm ...`: serve and generate with a model.

The native engine is not built yet; these commands resolve and validate the full
configuration (so flag and preset mistakes surface now) and then say what is missing.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sage_infer.cli.options import ConfigFileOpt, KVTransportOpt, ModelOpt, PresetOpt, SetOpt, resolve_flags
from sage_infer.errors import NotAvailableError

app = typer.Typer(help="Serve or run a model.", no_args_is_help=True)


@app.command("serve")
def serve(
    model: ModelOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require this bearer token.")] = None,
    preset: PresetOpt = None,
    config: ConfigFileOpt = None,
    kv_transport: KVTransportOpt = None,
    set_: SetOpt = None,
) -> None:
    """Start the OpenAI-compatible server."""
    named = {
        "model.path": ("--model", model),
        "host": ("--host", host),
        "port": ("--port", port),
        "api_key": ("--api-key", api_key),
    }
    resolve_flags(preset, config, kv_transport, set_, named)
    raise NotAvailableError(
        "sage llm serve: the native engine and the HTTP server are not implemented in this build yet "
        "(configuration resolved and valid)",
        hint="sage infer backends:list shows which engines are available",
    )
