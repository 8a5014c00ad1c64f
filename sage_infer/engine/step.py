"""Step executors: how a step's forward runs, chosen once at build (`sage_infer.engine.build`), as the attention
backend is (`sage_infer.layers.attention_backends`).

| executor | config | what runs |
|---|---|---|
| `PythonStep` | `model.elementwise: torch` | every layer from Python, PyTorch elementwise ops (the reference) |
| `FusedStep` | `model.elementwise: fused` | every layer from Python, norms, rotary and silu*mul as C++ passes |
| `CppDecodeStep` | `model.decode_step: sage` | a decode step's layers in one C++ call; other steps as `FusedStep` |
| `GraphStep` | `model.cuda_graphs: on` | a pure decode step replays a CUDA graph; other steps as `PythonStep` |

The `ModelRunner` shapes the step (`prepare`) and hands it to its executor's `run`; a new way to run steps (a
graph of verify rows, an NPU graph) is a new executor here and one choice in build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sage_infer.core.sequence import Sequence

if TYPE_CHECKING:
    from sage_infer.engine.cuda_graphs import DecodeGraphs
    from sage_infer.engine.model_runner import ModelRunner


class PythonStep:
    """Every decoder layer from Python, PyTorch elementwise ops: the reference."""

    name = "python"
    fused = False

    def run(self, runner: ModelRunner, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[torch.Tensor,
                                                                                                    list[int]]:
        """The step's logits [rows, vocab] (float32) and the indices into `seqs` of the rows' sequences."""
        input_ids, positions, meta, sample_rows, sampled = runner.prepare(seqs, num_new_tokens)
        hidden = self.forward(runner, input_ids, positions, meta)
        logits = runner.model.compute_logits(hidden[sample_rows]) if sample_rows else hidden.new_empty((0, 0))
        return logits, sampled

    def forward(self, runner: ModelRunner, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return runner.model(input_ids, positions, runner.pool, meta, fused=self.fused)


class FusedStep(PythonStep):
    """Every layer from Python, its norms, rotary and silu*mul as C++ passes (`LlamaForCausalLM.forward_fused`)."""

    name = "fused"
    fused = True


class CppDecodeStep(FusedStep):
    """A decode step (every row one new token, with or without a prefix all rows share) runs every layer in one
    C++ call (csrc/decode_step.cpp); any other step as `FusedStep`. `handle` is the model's C++ step over the
    runner's pool (`LlamaForCausalLM.prepare_decode_step`)."""

    name = "cpp-decode"

    def __init__(self, handle: object) -> None:
        self.handle = handle

    def forward(self, runner: ModelRunner, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return runner.model(input_ids, positions, runner.pool, meta, fused=True, decode_step=self.handle)


class GraphStep(PythonStep):
    """A pure decode step within the largest bucket replays a CUDA graph (`DecodeGraphs`); others run as
    `PythonStep`."""

    name = "cuda-graphs"

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs

    def run(self, runner: ModelRunner, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[torch.Tensor,
                                                                                                    list[int]]:
        if self.graphs.fits(seqs, num_new_tokens):
            return self.graphs.run(seqs), list(range(len(seqs)))
        return super().run(runner, seqs, num_new_tokens)
