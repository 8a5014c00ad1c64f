"""`PrefetchStats`: what reading KV ahead of need bought and what it cost.

A prefetch moves a request's blocks out of a lower tier before admission asks for them (`KVLoader`,
when the request is queued); the replay simulator counts its own the same way (`sim.tiered`). Each
one ends used (its request claimed at least one of the blocks) or wasted: `timeout` (admission came
before the read finished and recomputed instead), `dropped` (the request ended, or its device prefix
changed, first) or `evicted` (the blocks were gone from the tier, or failed verification, when
claimed). Blocks read but not claimed are wasted bandwidth even for a used prefetch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WASTE_REASONS = ("timeout", "dropped", "evicted")


@dataclass(slots=True)
class PrefetchStats:
    issued: int = 0  # prefetches started
    used: int = 0  # claimed with at least one block
    wasted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WASTE_REASONS, 0))  # reason -> prefetches
    blocks_read: int = 0  # blocks the prefetches moved (or are moving)
    blocks_used: int = 0  # of those, claimed by their request
    blocks_wasted: int = 0  # of those, moved for nothing

    def issue(self, blocks: int) -> None:
        self.issued += 1
        self.blocks_read += blocks

    def use(self, blocks_used: int, blocks_read: int) -> None:
        """A prefetch of `blocks_read` blocks was claimed, `blocks_used` of them taken (0: the tier lost them)."""
        if blocks_used == 0:
            self.waste("evicted", blocks_read)
            return
        self.used += 1
        self.blocks_used += blocks_used
        self.blocks_wasted += blocks_read - blocks_used

    def waste(self, reason: str, blocks: int) -> None:
        """A prefetch ended unused (`reason` in `WASTE_REASONS`), its `blocks` moved for nothing (0: never read)."""
        self.wasted[reason] += 1
        self.blocks_wasted += blocks

    @property
    def hit_ratio(self) -> float:
        """Used ÷ issued (0 before the first prefetch); prefetches still reading count as not used yet."""
        return self.used / self.issued if self.issued else 0.0

    @property
    def timeouts(self) -> int:
        return self.wasted["timeout"]

    @property
    def dropped(self) -> int:
        return self.wasted["dropped"]
