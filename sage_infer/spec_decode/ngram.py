"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a sequence's
last n tokens, for the longest n in [min, max] that occurs. Where that copy reaches the sequence's end it goes on
copying what it proposed (as an overlapping LZ77 copy does): in a loop of period p the latest occurrence is p tokens
back, and a proposal cut at the end would hold at most p tokens whatever k.

Each sequence keeps an index of every n-gram of its tokens (n in [min, max]) to the position after its latest
occurrence, grown by the tokens appended since the last proposal, so a proposal costs O(max - min + 1) lookups
and each token is indexed once, whatever the context length. Output that repeats the prompt (code edits, quoting,
summaries, retrieval answers) or itself (lists, tables, loops) is where the guesses are right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.spec_decode.base import Proposer


@dataclass(slots=True)
class _Index:
    upto: int = 0  # n-grams ending before this position are indexed
    after: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> the position after its latest


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int,
                 disable_by_batch_size: int | None = None, adaptive: bool = False) -> None:
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max, got {lookup_min}, {lookup_max}")
        super().__init__(num_speculative_tokens, disable_by_batch_size, adaptive)
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._indexes: dict[int, _Index] = {}  # seq id -> its n-gram index

    def propose(self, seq_id: int, token_ids: list[int], limit: int, tenant: bytes = b"") -> list[int]:
        """Up to min(k, `limit`) tokens to follow `token_ids` (the sequence's prompt and output); [] when its
        last n tokens occur nowhere earlier for any n in [min, max]."""
        length = len(token_ids)
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = _Index()
        limit = self.limit(seq_id, limit)
        if limit <= 0 or length <= self.lookup_min:
            return []
        after = index.after
        # index the n-grams that end before the last position: the suffix itself must match an earlier copy
        for end in range(max(index.upto, self.lookup_min), length):
            for n in range(self.lookup_min, min(self.lookup_max, end) + 1):
                after[tuple(token_ids[end - n:end])] = end
        index.upto = max(index.upto, length)
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            start = after.get(tuple(token_ids[length - n:]))
            if start is not None:
                proposal = token_ids[start:start + limit]
                while len(proposal) < limit:  # past the end: the copy continues from its own tokens
                    proposal.append(proposal[start + len(proposal) - length])
                return proposal
        return []

    def forget(self, seq_id: int, tenant: bytes = b"", output: Sequence[int] = ()) -> None:
        """Drop a finished sequence's index."""
        super().forget(seq_id)
        self._indexes.pop(seq_id, None)
