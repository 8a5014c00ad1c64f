"""Which sequences of a step share leading KV blocks, for cascade attention.

With prefix caching, requests behind one system prompt get block tables that start with the
same pool block ids. Attending to those keys once for all of them, instead of once per
sequence, is what `SharedPrefix` metadata asks attention to do.
"""

from __future__ import annotations

from collections import defaultdict

import torch

MIN_SHARED_SEQS = 2  # fewer participants: nothing is attended once instead of several times
MIN_SHARED_BLOCKS = 4  # the shortest shared prefix the break-even below was measured at
# Cascade attention costs a fixed extra per layer (a second kernel call per decode group, the
# merge), so it pays off only once the key reads it saves, (participants - 1) x shared tokens,
# pass a break-even, measured with `bench/cascade_attention.py --kernel` (docs/benchmarks.md
# "Cascade attention"). It is far lower in bf16 and fp16, where the reference path's masked SDPA
# is much slower than in float32.
MIN_SAVED_TOKENS = {torch.float32: 8192, torch.bfloat16: 384, torch.float16: 384}


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two block-id lists (slice compares run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # largest m with a[:m] == b[:m]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_shared_prefix(tables: list[list[int]], min_saved_blocks: int = 0) -> tuple[list[int], int]:
    """The sequences to attend a shared prefix together, and how many leading blocks they share.

    tables: per sequence, the block ids that may be shared (those wholly before its first query
    of the step; empty if none) -> (indices into `tables`, number of shared blocks), or
    ``([], 0)`` unless at least `MIN_SHARED_SEQS` sequences share at least `MIN_SHARED_BLOCKS`
    blocks and attending them once saves at least `min_saved_blocks` block reads.

    Starting from the largest group with the same first block, the group follows its majority
    one divergence at a time (the sequences that agree on the next block after the common
    prefix); of the groups seen, the one that saves the most block reads,
    ``(members - 1) * shared blocks``, wins. The common prefix of a group is that of its
    lexicographically smallest and largest table, so a step whose sequences all share one
    prefix costs a few list comparisons.
    """
    by_block: dict[int, list[int]] = defaultdict(list)
    for i, table in enumerate(tables):
        if len(table) >= MIN_SHARED_BLOCKS:
            by_block[table[0]].append(i)
    group = max(by_block.values(), key=len, default=[])
    best: tuple[list[int], int] = ([], 0)
    while len(group) >= MIN_SHARED_SEQS:
        members = [tables[i] for i in group]
        depth = common_prefix_len(min(members), max(members))
        if depth >= MIN_SHARED_BLOCKS and (len(group) - 1) * depth > (len(best[0]) - 1) * best[1]:
            best = (group, depth)
        by_block = defaultdict(list)
        for i in group:  # those that go on past the common prefix, split by their next block
            if len(tables[i]) > depth:
                by_block[tables[i][depth]].append(i)
        group = max(by_block.values(), key=len, default=[])
    return best if (len(best[0]) - 1) * best[1] >= min_saved_blocks else ([], 0)
