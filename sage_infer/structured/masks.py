"""The token masks of one step: for every sampled row of a constrained sequence, a bitmask of the tokens its
grammar allows next, computed by llguidance's parallel executor on a worker thread while the model runs (the
masks of step t depend only on the tokens accepted by step t-1, known before the forward starts)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from sage_infer.core.sequence import Sequence
from sage_infer.structured.matcher import GrammarMatcher

_MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sage-grammar-mask")
_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()  # its own threads: 80 % of the CPUs, at most 32
        return _EXECUTOR


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (bit t of the row: token t allowed)."""
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class TokenMask:
    """`forbidden[i]` ([len(rows), vocab] bool) marks the tokens logits row `rows[i]` may not take; rows not
    listed are unconstrained. `rows` ascend."""

    rows: list[int]
    forbidden: torch.Tensor


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit set: allowed) -> [rows, vocab_size] bool, True where forbidden. numpy's
    unpackbits, one pass on one thread: it runs beside the model's forward, whose threads it must not contend
    with (the words are little-endian, so their bytes unpack LSB-first in token order)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits == 0)


def fill_bitmask(entries: list[tuple[GrammarMatcher, list[int]]], vocab_size: int) -> torch.Tensor:
    """Masks for each (matcher, proposed tokens): 1 + len(proposed) rows each, in order — the next token now,
    and after each proposed token in turn (the matcher is left where it was). [rows, words] int32."""
    num_rows = sum(1 + len(drafts) for _, drafts in entries)
    words = bitmask_words(vocab_size)
    bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)  # rows after a forbidden proposal: never kept
    plain, drafted, row = [], [], 0
    for matcher, drafts in entries:
        if drafts:
            drafted.append((matcher.ll, row, list(drafts)))
        else:
            plain.append((matcher.ll, row))
        row += 1 + len(drafts)
    executor = _executor()
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, num_rows)
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, num_rows)
    return bitmask


class PendingMasks:
    """The masks of one step being computed in the background (`start`); `for_rows` waits for them and lays
    them out as the step's logits rows."""

    def __init__(self, seqs: list[Sequence], num_new_tokens: list[int], vocab_size: int) -> None:
        self._first: dict[int, int] = {}  # index in seqs -> its first row in the bitmask
        entries = []
        row = 0
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            samples = seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_token_ids)
            if samples and seq.grammar is not None:
                self._first[i] = row
                entries.append((seq.grammar, seq.draft_token_ids))
                row += 1 + len(seq.draft_token_ids)
        self._future: Future | None = _MASK_THREAD.submit(self._compute, entries, vocab_size) if entries else None

    @staticmethod
    def _compute(entries: list[tuple[GrammarMatcher, list[int]]], vocab_size: int) -> torch.Tensor:
        return forbidden_tokens(fill_bitmask(entries, vocab_size), vocab_size)

    @classmethod
    def start(cls, seqs: list[Sequence], num_new_tokens: list[int], vocab_size: int) -> PendingMasks | None:
        """Start computing the masks of the step's constrained sequences; None if it has none."""
        if not any(seq.grammar is not None for seq in seqs):
            return None
        return cls(seqs, num_new_tokens, vocab_size)

    def for_rows(self, rows: list[int]) -> TokenMask | None:
        """The masks laid out for logits rows whose sequences are `rows` (indices into the step's seqs; a sequence
        with proposals once per verify row, consecutively)."""
        if self._future is None:
            return None
        forbidden = self._future.result()
        picked, index = [], []
        seen: dict[int, int] = {}
        for r, i in enumerate(rows):
            j = r - seen.setdefault(i, r)  # the verify position of row r
            if i in self._first:
                picked.append(r)
                index.append(self._first[i] + j)
        return TokenMask(picked, forbidden[index]) if picked else None
