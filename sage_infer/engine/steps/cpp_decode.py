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
    the model's C++ step over the runner's pool (`prepare_decode_step` of `LlamaForCausalLM` / `GemmaForCausalLM`).
    A model with KV groups (sliding-window layers) hands each group's slots and block tables: every group's
    metadata must be a pure decode step (cascade attention is off for such models)."""

    name = "cpp-decode"
    ops = FUSED_OPS

    def __init__(self, handle: object, max_rows: int | None = None) -> None:
        self.handle = handle
        self.max_rows = max_rows  # more rows run layer by layer (a mixture of experts' kernel limits)

    def forward(self, runner: ModelRunner, batch: StepBatch, meta: AttentionMetadata) -> torch.Tensor:
        if self.max_rows is not None and batch.num_rows > self.max_rows:
            return super().forward(runner, batch, meta)
        shared = None
        metas = meta.groups or (meta,)
        groups = [group_meta.pure_decode_group() for group_meta in metas]
        # an int8 pool's shared prefix is attended in Python (its keys dequantized, `gather_blocks`)
        if groups[0] is None and not meta.groups and runner.pool.supports_block_views:
            groups = [meta.cascade_decode_group(batch.num_rows)]
            shared = meta.shared.block_ids if groups[0] is not None else None
        if any(group is None for group in groups):
            return super().forward(runner, batch, meta)
        runner.pool.finish_loads()  # the C++ step reads the pool without `paged_attention`'s per-layer waits
        x, h, (cos, sin, *local) = runner.model.embed(batch.input_ids, batch.positions, self.ops)
        local_cos, local_sin = local or (None, None)
        return self.handle.run(h, x, cos, sin, local_cos, local_sin, [group_meta.slot_mapping for group_meta in metas],
                               [group.block_tables for group in groups], [group.context_lens for group in groups],
                               shared, shared is not None and meta.backend.prefill.sage_flash_prefix)
