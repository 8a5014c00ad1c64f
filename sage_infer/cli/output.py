"""Render command results: a rich table for people, the same data as JSON for machines."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from rich.console import Console

from sage_infer.tables import table

__all__ = ["console", "emit", "table", "yes_no"]

console = Console()


def emit(data: object, as_json: bool, render: Callable[[Console], None]) -> None:
    """Print `data` as JSON (stdout, nothing else) or call `render` for the human view."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render(console)


def yes_no(flag: bool) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"
