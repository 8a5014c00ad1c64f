"""`model.prefill_attention: sage` on an NVIDIA GPU: every prefill span of a step in one Triton launch per layer,
reading its context in place from the pool's blocks (`sage_infer.layers.triton_paged.prefill_attention`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.core.step_batch import SeqSpan, StepBatch
from sage_infer.layers.attention import AttentionMetadata, PrefillSpan
from sage_infer.layers.attention_backends.base import PrefillPart
from sage_infer.layers.attention_kinds import FULL_ATTENTION, AttentionKind

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


@dataclass(slots=True)
class PagedPrefill:
    """A step's prefill spans (`AttentionMetadata.prefills`, in order) as the kernel takes them: the
    `AttentionMetadata.prefill_context` of `TritonPrefill`."""

    block_tables: torch.Tensor  # [S, W] long: span s's context blocks, padded with 0
    spans: torch.Tensor  # [S, 3] int32: first row in the flat batch, queries, context tokens
    tiles: torch.Tensor  # [N, 2] int32: (span, first query) of each program (`triton_paged.prefill_tiles`)


@dataclass(frozen=True)
class TritonPrefill(PrefillPart):
    """Every prefill span of a step in one launch per layer, in place (an NVIDIA GPU, a float pool), under the
    layer's sliding window, logit soft-cap and sinks too. It reads each row's shared prefix in place, so there is
    no cascade."""

    name = "sage"
    in_place = True
    supports_cascade = False

    def prepare(self, batch: StepBatch, spans: list[SeqSpan],
                suffixes: list[tuple[int, SeqSpan]]) -> tuple[list[PrefillSpan], PagedPrefill | None, list]:
        from sage_infer.layers.triton_paged import prefill_tiles  # imports triton: only where the kernel runs

        assert not suffixes, "the Triton prefill reads shared prefixes in place: no cascade"
        if not spans:
            return [], None, []
        rows = [(span.q_start, span.q_len, span.context_len) for span in spans]
        tables = [span.block_table[: -(-span.context_len // batch.block_size)] for span in spans]
        width = max(map(len, tables))
        context = PagedPrefill(block_tables=batch.tensor([t + [0] * (width - len(t)) for t in tables]),
                               spans=batch.tensor(rows, torch.int32),
                               tiles=batch.tensor(prefill_tiles(rows), torch.int32))
        return [PrefillSpan(*row, slot_start=0) for row in rows], context, []

    def attend_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                     meta: AttentionMetadata, out: torch.Tensor, scale: float,
                     kind: AttentionKind = FULL_ATTENTION) -> None:
        from sage_infer.layers.triton_paged import prefill_attention  # imports triton

        paged = meta.prefill_context
        prefill_attention(q, *pool.block_views(layer), out, paged.block_tables, paged.spans, paged.tiles, scale,
                          kind)

    def declines(self, kind: AttentionKind, device: torch.device) -> str | None:
        return None  # the kernel takes any window, soft-cap and sinks (`AttentionBackend.forward_kind`: in place)

    def span_context(self, pool: KVPool, layer: int, meta: AttentionMetadata, index: int, span: PrefillSpan,
                     dtype: torch.dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        first = start // pool.block_size  # only the blocks from the one holding token `start`
        table = meta.prefill_context.block_tables[index : index + 1, first : -(-span.context_len // pool.block_size)]
        keys, values = pool.gather_blocks(layer, table, dtype)
        skip = start - first * pool.block_size
        return keys[0, skip : span.context_len - first * pool.block_size], \
            values[0, skip : span.context_len - first * pool.block_size]
