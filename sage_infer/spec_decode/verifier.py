"""Exact verification of proposed tokens.

The target samples each verify row as it would sample that position without speculation: row j of a sequence
with proposals d_1..d_k sees the history extended by d_1..d_j, with the same penalties, temperature, top-k/top-p
and the sequence's own generator. Proposal d_{j+1} stands when the target's token at row j equals it; the first
row where they differ gives the target's token instead, and the rows after it are discarded.

For greedy rows this is token identity with decoding one token at a time. For sampled rows it is the rejection
sampling of Leviathan et al. and Chen et al. for a proposer whose distribution is a point mass (n-gram, suffix):
the proposal is accepted with probability p(d) (the chance the target's draw equals it), and a rejected row's
token is distributed as p with d removed and renormalised (the target's draw, conditioned on differing), which
is exactly the residual max(0, p - q) / Z of the general rule. So every emitted token has the target's
distribution, and a seeded request draws from its generator once per emitted token, as without speculation.
"""

from __future__ import annotations


def accept(proposed: list[int], target: list[int]) -> list[int]:
    """The tokens a verify step emits: the proposals up to the first one the target disagrees with, then the
    target's own token at that row (or, all accepted, the target's token after the last proposal).
    `target` has one token per verify row: len(proposed) + 1."""
    assert len(target) == len(proposed) + 1
    for j, token in enumerate(proposed):
        if target[j] != token:
            return target[: j + 1]
    return list(target)
