"""Render command results: a rich table for people, the same data as JSON for machines."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

console = Console()


def emit(data: object, as_json: bool, render: Callable[[Console], None]) -> None:
    """Print `data` as JSON (stdout, nothing else) or call `render` for the human view."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render(console)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column)
    for row in rows:
        out.add_row(*("" if cell is None else str(cell) for cell in row))
    return out


def yes_no(flag: bool) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"
