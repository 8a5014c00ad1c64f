"""Step executors: how a step's forward runs, chosen once at build (`sage_infer.engine.build`), as the attention
backend is (`sage_infer.layers.attention_backends`). Each is one file here, registered below and imported when
chosen:

| executor | config | file | what runs |
|---|---|---|---|
| `python` | `model.elementwise: torch` | `python.py` | every layer from Python, PyTorch ops (the reference) |
| `fused` | `model.elementwise: fused` | `fused.py` | every layer from Python, norms, rotary, silu*mul in C++ |
| `cpp-decode` | `model.decode_step: sage` | `cpp_decode.py` | a decode step's layers in one C++ call; others fused |
| `cuda-graphs` | `model.cuda_graphs: on` | `cuda_graphs.py` | a pure decode step replays a CUDA graph; others python |

The `ModelRunner` builds the step's neutral batch; the executor's `run` derives what it calls from it
(`StepExecutor`). A new way to run steps (a graph of verify rows, an NPU graph) is a new file here and one line
below.
"""

from __future__ import annotations

import importlib

from sage_infer.engine.steps.base import StepExecutor

STEP_EXECUTORS: dict[str, str] = {  # name -> module:class, imported when chosen
    "python": "python:PythonStep",
    "fused": "fused:FusedStep",
    "cpp-decode": "cpp_decode:CppDecodeStep",
    "cuda-graphs": "cuda_graphs:GraphStep",
}


def step_executor(name: str, *args: object) -> StepExecutor:
    """The registered executor `name`, built with `args` (the C++ step's handle, the graphs' buffers)."""
    if name not in STEP_EXECUTORS:
        raise ValueError(f"unknown step executor {name!r} (known: {', '.join(STEP_EXECUTORS)})")
    module, cls = STEP_EXECUTORS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(*args)


__all__ = ["STEP_EXECUTORS", "StepExecutor", "step_executor"]
