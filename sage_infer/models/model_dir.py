"""Where a model comes from: a local Hugging Face directory, or the bundled demo model. No weights, no torch:
a router reads a model's tokenizer and config.json through this too."""

from __future__ import annotations

import json
from pathlib import Path

from sage_infer.errors import SageError

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_DRAFT_DIR = Path(__file__).resolve().parent.parent / "demo_model_draft"  # its draft for speculative.model


class ModelLoadError(SageError):
    """A model directory that cannot be loaded: the message names the file or architecture."""

    exit_code = 2


def resolve_model_dir(path: str | Path | None) -> Path:
    """The model directory to load: `path`, or the bundled demo model when None."""
    directory = DEMO_MODEL_DIR if path is None else Path(path).expanduser()
    if not directory.is_dir():
        what = "bundled demo model" if path is None else "model directory"
        raise ModelLoadError(f"{directory}: {what} not found (models are loaded from local directories only)")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory / 'config.json'}: not found; expected a Hugging Face model directory")
    return directory


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: cannot read: {err}") from None
