"""`model.elementwise: fused`: every decoder layer from Python, its norms, rotary and silu*mul as C++ passes."""

from __future__ import annotations

from sage_infer.engine.steps.base import StepExecutor
from sage_infer.layers.elementwise import FUSED_OPS


class FusedStep(StepExecutor):
    """Every layer from Python, the elementwise ops fused (`sage_infer.layers.elementwise.FusedOps`)."""

    name = "fused"
    ops = FUSED_OPS
