"""`LifetimePredictor`: how likely a cached block is to be reused soon, learned online.

Every cached block belongs to a *class* (the policy decides which: how often the block
was reused, whether it ended its request's chain, ...). For each class the predictor
keeps two decayed histograms over the block's *age* (time since its last use):

- `hits[a]`: reuses that came at age `a` (the inter-arrival gap of consecutive uses);
- `evictions[a]`: blocks of the class that left the cache at age `a` unused.

From them it derives the *hit density* of a block of age `a` (Beckmann et al., "LHD:
Improving Cache Hit Rate by Maximizing Hit Density", NSDI'18):

    density(a) = P(reused | survived to a) / E[remaining time in cache | a]
               = sum_{x>=a} hits[x] / sum_{x>=a} (x - a) * (hits[x] + evictions[x])

i.e. expected hits per unit of cache space-time still to be spent on the block. The
block with the lowest density is the one whose space buys the fewest hits: evict it.
A block just past the typical return gap of its class (a multi-turn conversation whose
user did not come back) scores low; one whose class returns often and soon scores high.

Ages are bucketed logarithmically (`SUB_BUCKETS` per doubling of `unit`), so one
histogram spans milliseconds to hours without knowing the workload's time scale. The
histograms decay by `decay` at every refresh, so the prediction follows drift.
"""

from __future__ import annotations

import math

SUB_BUCKETS = 4  # buckets per doubling of age
NUM_BUCKETS = 96  # 24 doublings of `unit`: 1 s .. ~194 days at unit=1 s


class LifetimePredictor:
    """Per-class hit/eviction age histograms and the hit-density table derived from them."""

    __slots__ = ("num_classes", "unit", "decay", "hits", "evictions", "density", "_edges", "_mid", "_inv_unit",
                 "refreshes", "prior")

    def __init__(self, num_classes: int, unit: float = 1.0, decay: float = 0.9, prior: float = 8.0) -> None:
        if num_classes < 1:
            raise ValueError(f"need at least one class, got {num_classes}")
        if unit <= 0:
            raise ValueError(f"unit must be > 0, got {unit}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.num_classes = num_classes
        self.unit = unit
        self._inv_unit = 1.0 / unit
        self.decay = decay
        self.prior = prior
        self.hits = [[0.0] * NUM_BUCKETS for _ in range(num_classes)]
        self.evictions = [[0.0] * NUM_BUCKETS for _ in range(num_classes)]
        # lower edge and representative (geometric middle) age of each bucket, in clock units
        self._edges = [self._lower_edge(b) for b in range(NUM_BUCKETS + 1)]
        self._mid = [(self._edges[b] + self._edges[b + 1]) / 2.0 for b in range(NUM_BUCKETS)]
        # before any evidence: density falls with age (plain LRU order inside every class)
        self.density = [[1.0 / (1.0 + self._mid[b]) for b in range(NUM_BUCKETS)] for _ in range(num_classes)]
        self.refreshes = 0

    def _lower_edge(self, b: int) -> float:
        if b == 0:
            return 0.0
        return self.unit * (2.0 ** (b / SUB_BUCKETS) - 1.0)

    def bucket(self, age: float) -> int:
        """Histogram bucket of an age (clock units; negative ages count as 0)."""
        if age <= 0.0:
            return 0
        b = int(math.log2(1.0 + age * self._inv_unit) * SUB_BUCKETS)
        return b if b < NUM_BUCKETS else NUM_BUCKETS - 1

    def record_hit(self, cls: int, age: float) -> None:
        """A block of class `cls` was reused `age` after its previous use."""
        self.hits[cls][self.bucket(age)] += 1.0

    def record_eviction(self, cls: int, age: float) -> None:
        """A block of class `cls` left the cache `age` after its last use."""
        self.evictions[cls][self.bucket(age)] += 1.0

    def record_late_hit(self, cls: int, age: float, evicted_at: float) -> None:
        """A block evicted at age `evicted_at` came back at age `age` (a ghost hit): the eviction
        censored a reuse, so count the reuse instead of the eviction."""
        self.hits[cls][self.bucket(age)] += 1.0
        evs = self.evictions[cls]
        b = self.bucket(evicted_at)
        evs[b] = evs[b] - 1.0 if evs[b] > 1.0 else 0.0

    def score(self, cls: int, age: float) -> float:
        """Hit density of a block of class `cls` and this age (higher = keep)."""
        return self.density[cls][self.bucket(age)]

    def refresh(self) -> None:
        """Recompute the density table from the histograms, then decay them."""
        mid = self._mid
        nb = NUM_BUCKETS
        # shrink every class toward the pooled histograms with `prior` pseudo-events, so a
        # class with little evidence (or one evicted before any reuse could show) is not
        # written off: it behaves like the average block until its own data says otherwise
        pooled_h = [sum(self.hits[c][b] for c in range(self.num_classes)) for b in range(nb)]
        pooled_e = [sum(self.evictions[c][b] for c in range(self.num_classes)) for b in range(nb)]
        pooled_total = sum(pooled_h) + sum(pooled_e)
        scale = self.prior / pooled_total if pooled_total > 0 else 0.0
        for c in range(self.num_classes):
            hits = [h + scale * p for h, p in zip(self.hits[c], pooled_h, strict=True)]
            evs = [e + scale * p for e, p in zip(self.evictions[c], pooled_e, strict=True)]
            dens = self.density[c]
            hits_up = events_up = weighted_up = 0.0  # sums over buckets x >= b
            for b in range(nb - 1, -1, -1):
                events = hits[b] + evs[b]
                hits_up += hits[b]
                events_up += events
                weighted_up += mid[b] * events
                # remaining lifetime from the bucket's lower edge, at least one bucket width
                lifetime = weighted_up - self._edges[b] * events_up
                floor = (self._edges[b + 1] - self._edges[b]) * events_up
                lifetime = max(lifetime, floor)
                if lifetime > 0.0:
                    dens[b] = hits_up / lifetime
                else:  # nothing observed this old: keep the prior ordering, below anything seen
                    dens[b] = 0.0
        if self.decay < 1.0:
            for c in range(self.num_classes):
                hits, evs = self.hits[c], self.evictions[c]
                for b in range(nb):
                    hits[b] *= self.decay
                    evs[b] *= self.decay
        self.refreshes += 1

    # --- statistics of the learned gap distribution (for inspection and tests) ---

    def hit_mass(self, cls: int) -> float:
        return sum(self.hits[cls])

    def eviction_mass(self, cls: int) -> float:
        return sum(self.evictions[cls])

    def reuse_probability(self, cls: int) -> float:
        """Fraction of a class's blocks that were reused (before leaving the cache)."""
        hits, evs = self.hit_mass(cls), self.eviction_mass(cls)
        return hits / (hits + evs) if hits + evs > 0 else 0.0

    def gap_quantile(self, cls: int, q: float) -> float:
        """Age (clock units, bucket middle) below which a fraction `q` of the class's reuses came."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        hits = self.hits[cls]
        total = sum(hits)
        if total <= 0.0:
            return math.nan
        running = 0.0
        for b, h in enumerate(hits):
            running += h
            if running >= q * total:
                return self._mid[b]
        return self._mid[-1]

    def mean_gap(self, cls: int) -> float:
        hits = self.hits[cls]
        total = sum(hits)
        return sum(h * m for h, m in zip(hits, self._mid, strict=True)) / total if total > 0 else math.nan
