"""The one place where exceptions become what the user sees.

Known errors print ``sage: error: <one line>`` on stderr and exit with their code (2
for usage and config mistakes). ``SAGE_DEBUG=1`` re-raises to show the traceback.
"""

from __future__ import annotations

import os
import sys

import click
import typer

from sage_infer.errors import SageError

# typer >= 0.20 vendors its own copy of click; accept errors from either.
_typer_click = getattr(getattr(typer, "_click", None), "exceptions", None)
CLICK_ERRORS: tuple[type[Exception], ...] = tuple(
    {click.exceptions.ClickException, *([_typer_click.ClickException] if _typer_click else [])}
)
ABORTS: tuple[type[BaseException], ...] = tuple({click.exceptions.Abort, typer.Abort, KeyboardInterrupt})


def debug_enabled() -> bool:
    return os.environ.get("SAGE_DEBUG", "").lower() not in ("", "0", "false", "no")


def report(message: str, hint: str | None = None) -> None:
    line = message.replace("\n", " ").strip()
    if hint:
        line += f" (hint: {hint})"
    print(f"sage: error: {line}", file=sys.stderr)


def invoke(command: click.Command, argv: list[str]) -> int:
    """Run `command` on `argv` and return the exit code; never lets a known error escape."""
    try:
        result = command.main(args=argv, prog_name="sage", standalone_mode=False)
    except SageError as err:
        if debug_enabled():
            raise
        report(str(err), err.hint)
        return err.exit_code
    except CLICK_ERRORS as err:
        if debug_enabled():
            raise
        ctx = getattr(err, "ctx", None)
        context = ctx.command_path if ctx is not None else "sage"
        report(f"{context}: {err.format_message()}", f"{context} --help")
        return getattr(err, "exit_code", 2) or 2
    except ABORTS:
        report("aborted")
        return 130
    return result if isinstance(result, int) else 0
