"""`model.elementwise: torch`: every decoder layer from Python, PyTorch elementwise ops (the reference)."""

from __future__ import annotations

from sage_infer.engine.steps.base import StepExecutor


class PythonStep(StepExecutor):
    """Every layer from Python, PyTorch elementwise ops."""

    name = "python"
