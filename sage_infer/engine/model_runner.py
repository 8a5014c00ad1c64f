"""Turns a scheduled batch into one neutral step batch and runs the model over it."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from sage_infer.core.sequence import Sequence
from sage_infer.core.step_batch import SeqSpan, StepBatch, token_slots
from sage_infer.engine.shared_prefix import MIN_SAVED_TOKENS, find_shared_prefix
from sage_infer.engine.steps import StepExecutor, step_executor
from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.layers.attention import AttentionMetadata
from sage_infer.layers.attention_backends import REFERENCE, AttentionBackend


class GroupTables(Protocol):
    """What the runner reads of a KV manager with a block table per KV group (`GroupKVCacheManager`)."""

    groups: KVGroups
    num_groups: int

    def tables(self, seq: Sequence) -> list[list[int]]: ...


class ModelRunner:
    """Flattens each step into one neutral `StepBatch` (`batch`) and runs the model over it through its step
    executor (`sage_infer.engine.steps`, chosen once at build: the python one by default). How the step attends is
    the `attention` backend's (`sage_infer.layers.attention_backends`, the reference by default), which derives
    its own metadata from the batch; the runner knows no backend.

    `cascade_attention`: let sequences that share leading KV blocks attend to them once, together
    (`StepBatch.shared_seqs`), when that saves at least `cascade_min_saved_tokens` key reads (by the dtype attention
    runs in, the model's), where the backend supports it; off, every sequence reads its whole context (the
    reference path). `cascade_steps` counts the steps that used it. Without a `model` the runner only builds
    batches, for the pool's dtype."""

    def __init__(
        self, model: nn.Module | None, pool: KVPool, device: torch.device, cascade_attention: bool = True,
        attention: AttentionBackend = REFERENCE, step: StepExecutor | None = None,
        kv_groups: GroupTables | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.block_size
        self.attention = attention
        self.cascade_attention = cascade_attention and attention.supports_cascade
        dtype = next(model.parameters()).dtype if model is not None else pool.dtype
        self.cascade_min_saved_tokens = MIN_SAVED_TOKENS.get(dtype, MIN_SAVED_TOKENS[torch.float32])
        self.cascade_steps = 0
        assert not attention.prefill_in_place or pool.supports_block_views, "the prefill kernel reads float blocks"
        assert not attention.decode_in_place or pool.supports_block_views or pool.supports_int8_block_views, \
            "the decode kernels read float or int8 blocks"
        self.step = step if step is not None else step_executor("python")  # how the forward runs
        self.kv_groups = kv_groups  # a model with sliding-window layers: a block table per KV group
        assert kv_groups is None or not self.cascade_attention, "cascade attention reads one table per sequence"

    def batch(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepBatch:
        """Flatten the step: every sequence's new tokens as rows (a sequence with speculative proposals has them
        after its last token, one verify row each), its span of them, the rows whose logits are needed, and the
        sequences that share leading blocks of their cached context. Built as Python lists, moved to the device
        once."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        bs = self.block_size
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(input_ids)
            drafts = seq.draft_token_ids
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slot_mapping.extend(token_slots(seq.block_table, start, end, bs))
            spans.append(SeqSpan(row, n, start, seq.block_table, len(drafts)))
            if end == seq.num_tokens + len(drafts):  # the last row, and every verify row before it
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
                sampled.extend([i] * (len(drafts) + 1))
        participants, num_shared = self._shared_prefix(seqs)
        if participants:
            self.cascade_steps += 1

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return StepBatch(tensor(input_ids), tensor(positions), tensor(slot_mapping), spans, sample_rows, sampled,
                         bs, self.device, participants,
                         tuple(seqs[min(participants)].block_table[:num_shared]) if participants else ())

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[StepBatch, AttentionMetadata]:
        """The step's batch and the attention backend's metadata for it."""
        batch = self.batch(seqs, num_new_tokens)
        if self.kv_groups is None:
            return batch, self.attention.prepare(batch)
        return batch, self._prepare_groups(batch, seqs)

    def _prepare_groups(self, batch: StepBatch, seqs: list[Sequence]) -> AttentionMetadata:
        """The backend's metadata of every KV group (the batch is group 0's): each group's slots and tables; each
        layer reads its group's (`AttentionMetadata.groups`)."""
        tables = [self.kv_groups.tables(seq) for seq in seqs]
        metas = [self.attention.prepare(batch)]
        for group in range(1, self.kv_groups.num_groups):
            slots: list[int] = []
            spans = []
            for span, seq_tables in zip(batch.spans, tables):
                slots.extend(token_slots(seq_tables[group], span.start, span.start + span.q_len, self.block_size))
                spans.append(replace(span, block_table=seq_tables[group]))
            metas.append(self.attention.prepare(replace(batch, slot_mapping=batch.tensor(slots), spans=spans)))
        meta = replace(metas[0], groups=tuple(metas), layer_map=self.kv_groups.groups.layer_map)
        return meta

    def _shared_prefix(self, seqs: list[Sequence]) -> tuple[frozenset[int], int]:
        """Indices of the sequences that attend a shared prefix together, and its length in blocks.

        Only blocks wholly before a sequence's first query of the step can be shared: they hold
        keys computed before this step (a decode row's own new token is in a later block).
        """
        if not self.cascade_attention or len(seqs) < 2:
            return frozenset(), 0
        cached = [seq.block_table[: seq.num_computed_tokens // self.block_size] for seq in seqs]
        chosen, num_blocks = find_shared_prefix(cached, -(-self.cascade_min_saved_tokens // self.block_size))
        return frozenset(chosen), num_blocks

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Forward the step; returns logits [num_sampled, vocab] (float32) and the indices
        into `seqs` of the sequences they belong to (those whose chunk reached their end; a sequence with
        speculative proposals once per verify row)."""
        try:
            return self.step.run(self, seqs, num_new_tokens)
        finally:
            self.pool.finish_loads()  # admission's layer-wise loads: the step has read them; their rows go back
