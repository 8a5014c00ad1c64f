"""A rich table from a title, column names and rows: the one table shape the CLI and reports print."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column)
    for row in rows:
        out.add_row(*("" if cell is None else str(cell) for cell in row))
    return out
