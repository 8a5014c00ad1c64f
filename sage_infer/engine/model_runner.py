"""Turns a scheduled batch into one forward pass over the paged KV pool."""

from __future__ import annotations

import torch
from torch import nn

from sage_infer.core.sequence import Sequence
from sage_infer.engine.shared_prefix import MIN_SAVED_TOKENS, find_shared_prefix
from sage_infer.engine.step import PythonStep
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.layers.attention import AttentionMetadata, DecodeGroup, PagedPrefill, PrefillSpan, SharedPrefix
from sage_infer.layers.attention_backends import REFERENCE, AttentionBackend

DECODE_GROUP_ROWS = 16  # decode rows are sorted by context length and padded per group of this size
# with the paged kernel, a prefill chunk of at most this many tokens after cached context (a turn of a
# chat, a prompt's unique tail after a shared prefix) is attended as that many decode rows: each reads
# its causal context in place instead of a gathered copy per span and a Python loop over the spans
IN_PLACE_CHUNK_ROWS = 64


class ModelRunner:
    """Shapes each step for the `attention` backend (`sage_infer.layers.attention_backends`, chosen once at
    build; the reference, PyTorch ops only, by default) and runs the model over it.

    With a decode part that reads blocks in place (`decode_in_place`), every decode row is in one group and a
    chunk of at most `IN_PLACE_CHUNK_ROWS` after cached context becomes decode rows; otherwise decode rows are
    sorted into groups of gathered copies. With a prefill part that reads blocks in place (`prefill_in_place`,
    Triton), a step's spans get their block tables (`AttentionMetadata.paged_prefill`) instead of gathered slots.

    `cascade_attention`: let sequences that share leading KV blocks attend to them once, together
    (`SharedPrefix`), when that saves at least `cascade_min_saved_tokens` key reads (by the dtype attention runs
    in, the model's), where the backend supports it; off, every sequence reads its whole context (the reference
    path). `cascade_steps` counts the steps that used it. Without a `model` the runner only builds metadata
    (`prepare`), for the pool's dtype.

    `row_invariant` (`model.deterministic`): every query row, a prefill chunk's too, is a decode row of the
    in-place kernel, which reduces each row's context on its own, so a row's attention never depends on how its
    prompt was chunked or what else the step holds (needs a decode part that reads blocks in place)."""

    def __init__(
        self, model: nn.Module | None, pool: KVPool, device: torch.device, cascade_attention: bool = True,
        attention: AttentionBackend = REFERENCE, step: PythonStep | None = None, row_invariant: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.block_size
        self.attention = attention
        if row_invariant and not attention.decode_in_place:
            raise ValueError("row-invariant steps need a decode part that reads blocks in place (the paged kernel)")
        self.row_invariant = row_invariant
        self.cascade_attention = cascade_attention and attention.supports_cascade and not row_invariant
        dtype = next(model.parameters()).dtype if model is not None else pool.dtype
        self.cascade_min_saved_tokens = MIN_SAVED_TOKENS.get(dtype, MIN_SAVED_TOKENS[torch.float32])
        self.cascade_steps = 0
        assert not attention.prefill_in_place or pool.supports_block_views, "the prefill kernel reads float blocks"
        assert not attention.decode_in_place or pool.supports_block_views or pool.supports_int8_block_views, \
            "the decode kernels read float or int8 blocks"
        # the kernel reads only each row's own blocks, so padding costs nothing: one group of all rows
        self.decode_group_rows = 1 << 30 if attention.decode_in_place else DECODE_GROUP_ROWS
        self.step = step if step is not None else PythonStep()  # how the forward runs (`sage_infer.engine.step`)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, seqs: list[Sequence], num_new_tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Flatten the step: (input_ids [T], positions [T], metadata, rows whose logits are needed,
        indices into `seqs` of the sequences those rows belong to: a sequence with speculative proposals has
        one row per proposal after its last token's, in order).

        A sequence with one new token after others is a decode row (batched attention); with the
        paged kernel (and no prefill kernel), so is each token of a chunk of at most `IN_PLACE_CHUNK_ROWS`
        after cached context, its context ending at its own token (causal). Any other chunk is a prefill
        span.
        Sequences that share leading blocks of their cached context go to
        `AttentionMetadata.shared` instead, with their suffixes. Built as Python lists, moved to
        the device once.
        """
        attention = self.attention
        participants, num_shared = self._shared_prefix(seqs)
        shared_tokens = num_shared * self.block_size
        shared_rows: list[int] = []  # participants' query rows, prefill spans' first
        shared_prefills: list[PrefillSpan] = []
        shared_decode_rows: list[int] = []
        shared_decode_tables: list[list[int]] = []
        shared_decode_lens: list[int] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillSpan] = []
        prefill_slots: list[int] = []
        prefill_tables: list[list[int]] = []  # prefill_in_place: each span's context blocks, for the kernel
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            drafts = seq.draft_token_ids  # speculative: the proposals follow the last token, one verify row each
            if drafts:
                input_ids.extend(drafts)
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq.block_table, start, end))
            in_place = n == 1 or self.row_invariant or (attention.decode_in_place and not attention.prefill_in_place
                                                        and start > 0 and n <= IN_PLACE_CHUNK_ROWS)
            if i in participants:  # the context after the shared blocks is this sequence's suffix
                if in_place:  # row j of the chunk sees the suffix up to its own token
                    suffix = seq.block_table[num_shared:]
                    shared_decode_rows.extend(range(row, row + n))
                    shared_decode_tables.extend([suffix] * n)
                    shared_decode_lens.extend(range(start + 1 - shared_tokens, end + 1 - shared_tokens))
                else:
                    shared_prefills.append(PrefillSpan(len(shared_rows), n, end - shared_tokens, len(prefill_slots)))
                    shared_rows.extend(range(row, row + n))
                    if start > shared_tokens:
                        prefill_slots.extend(self._slots(seq.block_table, shared_tokens, end))
            elif in_place and (start > 0 or self.row_invariant):
                decode_rows.extend(range(row, row + n))
                decode_tables.extend([seq.block_table] * n)
                decode_lens.extend(range(start + 1, end + 1))
            else:
                prefills.append(PrefillSpan(row, n, end, len(prefill_slots)))
                if attention.prefill_in_place:
                    prefill_tables.append(seq.block_table[: -(-end // self.block_size)])
                elif start > 0:  # only spans with earlier context read keys back from the cache
                    prefill_slots.extend(self._slots(seq.block_table, 0, end))
            if end == seq.num_tokens + len(drafts):  # the last row, and every verify row before it
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
                sampled.extend([i] * (len(drafts) + 1))

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slot_mapping),
            prefills=prefills,
            prefill_slots=tensor(prefill_slots) if prefill_slots else None,
            decode_groups=self._decode_groups(decode_rows, decode_tables, decode_lens, tensor, self.decode_group_rows),
            backend=attention,
            paged_prefill=self._paged_prefill(prefills, prefill_tables) if prefill_tables else None,
        )
        if participants:
            local = list(range(len(shared_rows), len(shared_rows) + len(shared_decode_rows)))
            shared_rows.extend(shared_decode_rows)
            meta.shared = SharedPrefix(
                block_ids=tensor(seqs[min(participants)].block_table[:num_shared]),
                num_tokens=shared_tokens,
                rows=tensor(shared_rows),
                prefills=shared_prefills,
                decode_groups=self._decode_groups(local, shared_decode_tables, shared_decode_lens, tensor,
                                                   self.decode_group_rows),
            )
            self.cascade_steps += 1
        return tensor(input_ids), tensor(positions), meta, sample_rows, sampled

    def _paged_prefill(self, prefills: list[PrefillSpan], tables: list[list[int]]) -> PagedPrefill:
        from sage_infer.layers.triton_paged import prefill_tiles  # imports triton: only where the kernel runs

        spans = [(span.q_start, span.q_len, span.context_len) for span in prefills]
        width = max(map(len, tables))

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return PagedPrefill(block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.long),
                            spans=tensor(spans, torch.int32), tiles=tensor(prefill_tiles(spans), torch.int32))

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

    @staticmethod
    def _decode_groups(rows: list[int], tables: list[list[int]], lens: list[int], tensor,
                       group_rows: int = DECODE_GROUP_ROWS) -> list[DecodeGroup]:
        """Sort decode rows by context length and pad each group (of `group_rows`) only to its own longest."""
        if len(rows) <= group_rows:  # one group: the order changes nothing (and rows stay in batch order)
            order = list(range(len(rows)))
        else:
            order = sorted(range(len(rows)), key=lambda i: lens[i])
        groups = []
        for start in range(0, len(order), group_rows):
            chosen = order[start : start + group_rows]
            width = max(len(tables[i]) for i in chosen)
            groups.append(DecodeGroup(
                rows=tensor([rows[i] for i in chosen]),
                block_tables=tensor([tables[i] + [0] * (width - len(tables[i])) for i in chosen]),
                context_lens=tensor([lens[i] for i in chosen]),
                whole_batch=len(chosen) == len(rows) and rows == list(range(len(rows))),
            ))
        return groups

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Forward the step; returns logits [num_sampled, vocab] (float32) and the indices
        into `seqs` of the sequences they belong to (those whose chunk reached their end; a sequence with
        speculative proposals once per verify row)."""
        return self.step.run(self, seqs, num_new_tokens)
