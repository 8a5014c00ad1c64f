"""What every bench script does last: write its report as JSON where `--json` says (nothing without it)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path | None, report: dict, indent: int = 2) -> None:
    """Write `report` to `path` (its directory created); no-op when `path` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent))
