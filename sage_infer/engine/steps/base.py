"""What a step executor is: how one step's forward runs, from the runner's neutral batch to its logits."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.core.step_batch import StepBatch
from sage_infer.layers.attention import AttentionMetadata
from sage_infer.layers.elementwise import TORCH_OPS, TorchOps

if TYPE_CHECKING:
    from sage_infer.engine.model_runner import ModelRunner


class StepExecutor:
    """Runs a step: the runner's batch and the attention backend's metadata for it (`ModelRunner.prepare`), then
    `forward`: the model's one forward path with this executor's elementwise `ops` (`sage_infer.layers.elementwise`).
    An executor that runs some steps another way (one C++ call, a CUDA graph) overrides `run` or `forward` and falls
    back to this for the rest."""

    name: ClassVar[str]
    ops: ClassVar[TorchOps] = TORCH_OPS

    def run(self, runner: ModelRunner, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[torch.Tensor,
                                                                                                    list[int]]:
        """The step's logits [rows, vocab] (float32) and the indices into `seqs` of the rows' sequences."""
        batch, meta = runner.prepare(seqs, num_new_tokens)
        hidden = self.forward(runner, batch, meta)
        rows = batch.sample_rows
        logits = runner.model.compute_logits(hidden[rows]) if rows else hidden.new_empty((0, 0))
        return logits, batch.sampled

    def forward(self, runner: ModelRunner, batch: StepBatch, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of every row of the step."""
        return runner.model(batch.input_ids, batch.positions, runner.pool, meta, ops=self.ops)
