"""`model.decode_step: sage`: a decode step's decoder layers in one C++ call (csrc/decode_step.cpp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sage_infer.core.step_batch import StepBatch
from sage_infer.engine.steps.base import StepExecutor
from sage_infer.layers.attention import AttentionMetadata
from sage_infer.layers.elementwise import FUSED_OPS

if TYPE_CHECKING:
    from sage_infer.engine.model_runner import ModelRunner


class CppDecodeStep(StepExecutor):
    """A decode step (every row one new token, in batch order, read in place; with or without a prefix all rows
    share) runs every layer in one C++ call; any other step runs layer by layer with the fused ops. `handle` is
    the model's C++ step over the runner's pool (`LlamaForCausalLM.prepare_decode_step`)."""

    name = "cpp-decode"
    ops = FUSED_OPS

    def __init__(self, handle: object) -> None:
        self.handle = handle

    def forward(self, runner: ModelRunner, batch: StepBatch, meta: AttentionMetadata) -> torch.Tensor:
        shared = None
        group = meta.pure_decode_group()
        # an int8 pool's shared prefix is attended in Python (its keys dequantized, `gather_blocks`)
        if group is None and runner.pool.supports_block_views:
            group = meta.cascade_decode_group(batch.num_rows)
            shared = meta.shared.block_ids if group is not None else None
        if group is None:
            return super().forward(runner, batch, meta)
        x, h, (cos, sin) = runner.model.embed(batch.input_ids, batch.positions, self.ops)
        return self.handle.run(h, x, cos, sin, meta.slot_mapping, group.block_tables, group.context_lens, shared,
                               shared is not None and meta.backend.prefill.flash)
