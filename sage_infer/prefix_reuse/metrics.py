"""`PrefixReuseMetrics`: how much prompt KV the prefix cache saved."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixReuseMetrics:
    """Counters of prefix lookups since start (or the last `reset`).

    A query is one `PrefixReuseIndex.match`; it asks for `query_blocks` full blocks
    (`query_tokens` tokens) and finds the first `hit_blocks` of them cached.
    """

    queries: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of queried tokens served from cache (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def record(self, query_blocks: int, hit_blocks: int, block_size: int) -> None:
        """Count one query of `query_blocks` full blocks of which `hit_blocks` were cached."""
        self.queries += 1
        self.query_blocks += query_blocks
        self.hit_blocks += hit_blocks
        self.query_tokens += query_blocks * block_size
        self.hit_tokens += hit_blocks * block_size

    def reset(self) -> None:
        self.queries = self.query_blocks = self.hit_blocks = self.query_tokens = self.hit_tokens = 0

    def to_dict(self) -> dict:
        return {
            "queries": self.queries,
            "query_blocks": self.query_blocks,
            "hit_blocks": self.hit_blocks,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
        }
