"""The `sage` command: mounts one Typer app per command group."""

from __future__ import annotations

import sys

import typer

from sage_infer import __version__
from sage_infer.cli import compress, config, infer, kv, llm, transport
from sage_infer.cli.error_report import invoke

app = typer.Typer(
    name="sage",
    help="sage_infer: LLM inference built around KV-cache reuse.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(infer.app, name="infer")
app.add_typer(transport.app, name="transport")
app.add_typer(llm.app, name="llm")
app.add_typer(config.app, name="config")
app.add_typer(kv.app, name="kv")
app.add_typer(compress.app, name="compress")


def _version(value: bool) -> None:
    if value:
        print(f"sage_infer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """sage_infer: LLM inference built around KV-cache reuse."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sage` and `sage-infer` console scripts."""
    return invoke(typer.main.get_command(app), sys.argv[1:] if argv is None else argv)


def run() -> None:
    code = main()
    group = sys.modules.get("sage_infer.transport.process_group")  # loaded only where torchdist was used
    if group is not None:
        group.exit_process(code)  # a process that joined a torch.distributed group skips the teardown
    sys.exit(code)


if __name__ == "__main__":  # python -m sage_infer.cli.main (how `--pd` starts its workers)
    run()
