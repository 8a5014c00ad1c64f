"""sage_infer: LLM inference built around KV-cache reuse.

``from sage_infer import LLM, SamplingParams`` loads the engine on first use; importing
the package itself loads no optional heavy module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from sage_infer.backends.offline import LLM
    from sage_infer.core.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":  # the native engine's LLM, plus backend= (vllm, ...)
        from sage_infer.backends.offline import LLM

        return LLM
    if name == "SamplingParams":
        from sage_infer.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'sage_infer' has no attribute {name!r}")
