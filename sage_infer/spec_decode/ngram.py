"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a sequence's
last n tokens, for the longest n in [min, max] that occurs.

Each sequence keeps an index of every n-gram of its tokens (n in [min, max]) to the position after its latest
occurrence, grown by the tokens appended since the last proposal, so a proposal costs O(max - min + 1) lookups
and each token is indexed once, whatever the context length. Output that repeats the prompt (code edits, quoting,
summaries, retrieval answers) or itself (lists, tables, loops) is where the guesses are right.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Index:
    upto: int = 0  # n-grams ending before this position are indexed
    after: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> the position after its latest
    k: int = 0  # adaptive: this sequence's own limit (0: not set yet)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int,
                 disable_by_batch_size: int | None = None, adaptive: bool = False) -> None:
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max, got {lookup_min}, {lookup_max}")
        self.k = num_speculative_tokens
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.disable_by_batch_size = disable_by_batch_size  # the scheduler asks for nothing in bigger steps
        self.adaptive = adaptive  # each sequence's k follows its acceptance (`observe`)
        self._indexes: dict[int, _Index] = {}  # seq id -> its n-gram index

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, `limit`) tokens to follow `token_ids` (the sequence's prompt and output); [] when its
        last n tokens occur nowhere earlier for any n in [min, max]."""
        length = len(token_ids)
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = _Index(k=self.k)
        limit = min(index.k if self.adaptive else self.k, limit)
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
                return token_ids[start:start + limit]
        return []

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verify step's outcome for a sequence: with `adaptive`, nothing accepted halves its k, everything
        accepted raises it by one (within [1, num_speculative_tokens])."""
        index = self._indexes.get(seq_id)
        if not self.adaptive or index is None or not proposed:
            return
        if accepted == 0:
            index.k = max(1, index.k // 2)
        elif accepted == proposed:
            index.k = min(self.k, index.k + 1)

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's index."""
        self._indexes.pop(seq_id, None)
