"""One sequence's place in its grammar: which tokens may come next, advanced by every token it emits."""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    """An llguidance matcher for one sequence (each of a request's n sequences has its own). `ll` is the
    library's `LLMatcher`, for the batch mask computation (`masks.fill_bitmask`)."""

    __slots__ = ("ll",)

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self.ll = ll

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False (and the matcher broken) if the grammar forbids it."""
        return self.ll.consume_token(token_id)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (proposed next tokens) the grammar allows in a row, without advancing."""
        return self.ll.validate_tokens(token_ids) if token_ids else 0

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens."""
        if num_tokens and not self.ll.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher: cannot roll back {num_tokens} tokens: {self.ll.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (or, broken, allows nothing at all)."""
        return self.ll.is_stopped() or self.ll.is_error()

    @property
    def error(self) -> str | None:
        return self.ll.get_error() if self.ll.is_error() else None
