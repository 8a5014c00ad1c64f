"""Speculative decoding under structured outputs: a proposal the sequence's grammar forbids can never stand.

The verify step samples every verify row under the grammar's mask after the proposals before it
(`structured.masks`), so the target's token is always one the grammar allows and `accept` keeps a proposal only
when it equals that token. Cutting the proposals at the first forbidden token before the step (`grammar_allowed`)
saves the verify rows that could only be rejected; the grammar matcher itself only ever advances by emitted
tokens, so nothing needs rolling back after a rejection."""

from __future__ import annotations

from sage_infer.core.sequence import Sequence


def grammar_allowed(seq: Sequence, proposals: list[int]) -> list[int]:
    """`proposals` cut before the first token `seq`'s grammar forbids after its current output (all of them for
    an unconstrained sequence)."""
    if seq.grammar is None or not proposals:
        return proposals
    return proposals[: seq.grammar.valid_prefix(proposals)]
