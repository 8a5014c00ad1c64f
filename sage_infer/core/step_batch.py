"""One step's batch as neutral data: what every attention backend and step executor derives its own view from.

The `ModelRunner` flattens the scheduled sequences into token rows (`input_ids`, `positions`, `slot_mapping`,
built as Python lists and moved to the device once) and one `SeqSpan` per sequence: its query rows, the
context computed before the step, its block table, its speculative verify rows. Sequences that share leading
KV blocks of their cached context are named in `shared_seqs` with those blocks (`shared_blocks`). Nothing here
says how a step attends or runs: an attention backend's `prepare(batch)` turns it into that backend's
metadata, a step executor's `run` into its own calls.

A token at logical position ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The pool slots of a sequence's tokens ``[start, end)``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass(slots=True)
class SeqSpan:
    """One sequence's rows of the step: rows ``[q_start, q_start + q_len)`` of the flat batch are its tokens
    ``[start, start + q_len)`` (the last `num_drafts` of them speculative proposals, one verify row each)."""

    q_start: int
    q_len: int
    start: int  # tokens of context computed before this step (the sequence's num_computed_tokens)
    block_table: list[int]
    num_drafts: int = 0

    @property
    def context_len(self) -> int:
        """Tokens the step's last row of this span attends: the earlier context and the span itself."""
        return self.start + self.q_len


@dataclass(slots=True)
class StepBatch:
    """The flat rows of one step and each sequence's span of them.

    input_ids, positions, slot_mapping: [T] long on the step's device; `sample_rows`: the rows whose logits are
    needed, `sampled`: the index into `spans` of each of those rows' sequence (a sequence with proposals once
    per verify row, in order)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    spans: list[SeqSpan]
    sample_rows: list[int]
    sampled: list[int]
    block_size: int
    device: torch.device
    shared_seqs: frozenset[int] = frozenset()  # spans that attend `shared_blocks` together (cascade attention)
    shared_blocks: tuple[int, ...] = ()  # leading blocks every span of `shared_seqs` holds, all before its queries

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def shared_tokens(self) -> int:
        return len(self.shared_blocks) * self.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """The pool slots of a sequence's tokens ``[start, end)``."""
        return token_slots(block_table, start, end, self.block_size)

    def tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list as a tensor on the step's device (one copy)."""
        return torch.tensor(values, dtype=dtype, device=self.device)
