"""Multi-tier trace replay: device HBM through `PrefixReuseIndex` + `BlockManager`, lower
tiers (host, disk, remote) as exclusive block caches moved by `MigrationPolicy`.

The device tier runs the loop of `replay.replay` step for step (same index, manager,
policy hooks and call order); with no lower tier the two give identical hits. A
request's prefix run walks its leading blocks: a block on the device is a device hit,
else a block in a lower tier is that tier's hit and is promoted, else the run stops.
`run_capacity` replays every chosen policy at one capacity and returns the document
`sage kv replay --json` writes.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy.base import POLICIES, EvictionPolicy, make_policy
from sage_infer.kv_policy.cost_benefit import CostBenefitModel, ModelShape
from sage_infer.kv_policy.migration import BlockMeta, LowerTier, MigrationPolicy
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.sim.prefetch import QueuedPrefetch
from sage_infer.sim.replay import (
    EXTRA_KEY,
    ReplayResult,
    TraceCache,
    TraceRequest,
    distinct_blocks,
    ideal_hit_rate,
    replay,
)

TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id
TRACE_BLOCK_BYTES = ModelShape().kv_bytes_per_token * TRACE_BLOCK_TOKENS  # what a block's KV weighs (the sizes' model)
LOWER_TIERS = ("host", "disk", "remote")
PREFERRED_ORDER = ("lru", "lfu", "arc", "s3fifo", "cost", "sage")  # table order; others follow by name


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str  # device, host, disk or remote
    capacity_blocks: int


@dataclass(slots=True)
class TieredResult(ReplayResult):
    """`ReplayResult` counted over every tier (a hit in any tier is a hit), plus per-tier hits."""

    tier_hits: dict[str, int] = field(default_factory=dict)  # prefix-run hits by the tier that served them
    prefill_seconds_saved: float | None = None
    prefetch: QueuedPrefetch | None = None  # with lower tiers: the queued request's prefetch, counted

    def to_json(self) -> dict:
        prefetch = self.prefetch.to_json(TRACE_BLOCK_BYTES) if self.prefetch is not None else None
        return {"policy": self.policy, "hit_rate": self.hit_rate, "prefix_hit_rate": self.prefix_hit_rate,
                "tier_hits": dict(self.tier_hits), "prefill_seconds_saved": self.prefill_seconds_saved,
                "us_per_access": self.us_per_access, "prefetch": prefetch}


def block_tokens(request: TraceRequest, k: int) -> int:
    """Tokens in block `k` of `request`: full blocks, then whatever the last one holds."""
    return min(TRACE_BLOCK_TOKENS, max(1, request.input_length - k * TRACE_BLOCK_TOKENS))


def _seconds_saved(cost: CostBenefitModel | None, served: Counter) -> float | None:
    """Σ (recompute − load) over hits, given as a Counter of (tier, tokens, depth)."""
    if cost is None:
        return None
    return sum(n * cost.saved_seconds(tier, tokens, depth, context_tokens=depth * TRACE_BLOCK_TOKENS)
               for (tier, tokens, depth), n in served.items())


def replay_device(
    requests: Sequence[TraceRequest], policy: str, capacity_blocks: int, cost: CostBenefitModel | None = None
) -> TieredResult:
    """One device tier: `replay.replay` itself, plus the prefill seconds its hits save."""
    base = replay(requests, policy, capacity_blocks, keep_per_request=True)
    served: Counter = Counter()
    for request, hit in zip(requests, base.per_request_prefix_hits):
        for k in range(hit):
            served["device", block_tokens(request, k), k] += 1
    return TieredResult(base.policy, capacity_blocks, base.requests, base.accesses, base.block_hits,
                        base.prefix_hits, base.seconds, base.per_request_prefix_hits,
                        tier_hits={"device": base.prefix_hits}, prefill_seconds_saved=_seconds_saved(cost, served))


def replay_tiered(
    requests: Sequence[TraceRequest],
    policy: str | EvictionPolicy,
    tiers: Sequence[TierSpec],
    cost: CostBenefitModel | None = None,
) -> TieredResult:
    """Replay through the device (`tiers[0]`) and the lower tiers below it, fastest first.

    The device is `replay.replay`'s `TraceCache`; a block its eviction reclaims reaches the
    `KVCacheManager`'s `on_evict` hook, which hands it to `MigrationPolicy.demote`.
    """
    assert tiers and tiers[0].name == "device", "the first tier is the device"
    capacity = tiers[0].capacity_blocks
    # a policy object sizes the device as its caller did (the engine sizes by its whole pool);
    # the lower tiers get the same kind of policy, sized by their own capacity
    device_policy = make_policy(policy, capacity=capacity) if isinstance(policy, str) else policy
    migration = MigrationPolicy([LowerTier(t.name, t.capacity_blocks,
                                           make_policy(device_policy.name, capacity=t.capacity_blocks))
                                 for t in tiers[1:]], cost)
    cache = TraceCache(device_policy, capacity)
    meta: dict[bytes, BlockMeta] = {}  # what each block on the device is, for its demotion
    def demote(blocks) -> None:
        for block in blocks:
            migration.demote(block.block_hash, meta.pop(block.block_hash))

    cache.kv.on_evict = demote
    result = TieredResult(device_policy.name, capacity, tier_hits={t.name: 0 for t in tiers},
                          prefetch=QueuedPrefetch(EXTRA_KEY))
    served: Counter = Counter()
    start = time.perf_counter()
    for i, request in enumerate(requests):
        seq, match = cache.begin(i, request)
        migration.tick(cache.now)
        ids = request.hash_ids
        hit = len(match.block_ids)
        chain = match.block_hashes[-1] if hit else None
        promoted: list[tuple[int, bytes, LowerTier]] = []
        run = hit
        while run < len(ids):  # the prefix run goes on through lower tiers
            key = hash_block(chain, (ids[run],), EXTRA_KEY)
            tier = migration.promote(key)
            if tier is None:
                break
            promoted.append((run, key, tier))
            chain, run = key, run + 1
        result.prefetch.settle([key for _, key, _ in promoted], match.block_hashes)
        if i + 1 < len(requests):  # the next request waits in the queue while this one runs: read its prefix
            result.prefetch.issue(requests[i + 1].hash_ids, cache.index, migration)
        present = run
        for token in ids[run:]:  # block-level counting past the first miss
            chain = hash_block(chain, (token,), EXTRA_KEY)
            present += cache.index.block_of(chain) is not None or migration.tier_of(chain) is not None

        cache.admit_and_compute(seq, match)
        hashes = seq.block_hashes
        for k in range(hit, len(hashes)):
            migration.discard(hashes[k])
            meta[hashes[k]] = BlockMeta(k, hashes[k - 1] if k else None, block_tokens(request, k))
        for k, key, tier in promoted:
            if k >= len(hashes):  # the device had no room for it: back where it came from
                parent = None if k == 0 else hashes[k - 1] if k <= len(hashes) else promoted[k - 1 - hit][1]
                migration.put_back(key, BlockMeta(k, parent, block_tokens(request, k)), tier)
        cache.kv.free(seq)

        result.requests += 1
        result.accesses += len(ids)
        result.block_hits += present
        result.prefix_hits += run
        result.tier_hits["device"] += hit
        for k in range(hit):
            served["device", block_tokens(request, k), k] += 1
        for k, _key, tier in promoted:
            result.tier_hits[tier.name] += 1
            served[tier.name, block_tokens(request, k), k] += 1
        result.per_request_prefix_hits.append(run)
    result.seconds = time.perf_counter() - start
    result.prefill_seconds_saved = _seconds_saved(cost, served)
    return result


def all_policies() -> list[str]:
    """Every registered policy except OPT (it needs the future; it is always reported apart)."""
    names = [n for n in POLICIES if n != "opt"]
    rank = {n: i for i, n in enumerate(PREFERRED_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def opt_rates(requests: Sequence[TraceRequest], capacity_blocks: int) -> tuple[dict | None, str | None]:
    """Belady's OPT at this capacity from `sim.opt.replay_opt`: (rates, None) or (None, why not)."""
    module = "sage_infer.sim.opt"
    try:
        replay_opt = importlib.import_module(module).replay_opt
    except ModuleNotFoundError as err:
        return None, f"{module} is not available ({'not written yet' if err.name == module else err})"
    except AttributeError:
        return None, f"{module} has no replay_opt"
    except Exception as err:
        return None, f"{module} fails to import: {type(err).__name__}: {err}"
    out = replay_opt(requests, capacity_blocks)
    read = out.get if isinstance(out, dict) else lambda name: getattr(out, name)
    return {"hit_rate": float(read("hit_rate")), "prefix_hit_rate": float(read("prefix_hit_rate"))}, None


def run_capacity(
    requests: Sequence[TraceRequest],
    trace: str,
    capacity_blocks: int,
    policies: Sequence[str],
    lower_tiers: Sequence[TierSpec] = (),
    cost: CostBenefitModel | None = None,
) -> tuple[dict, list[str]]:
    """Replay each policy at one device capacity; the `--json` document and notes for people."""
    notes = []
    opt, why = opt_rates(requests, capacity_blocks)
    if why:
        notes.append(f"OPT not reported: {why}")
    tiers = [TierSpec("device", capacity_blocks), *lower_tiers]
    results = []
    for name in policies:
        if lower_tiers:
            results.append(replay_tiered(requests, name, tiers, cost))
        else:
            results.append(replay_device(requests, name, capacity_blocks, cost))
    if opt is not None:
        # OPT is the device alone: compare the device's own hits, not hits the lower tiers added
        beaten = [r.policy for r in results
                  if r.tier_hits["device"] / max(r.accesses, 1) > opt["prefix_hit_rate"] + 0.005]
        if beaten:  # leaf-only eviction can let a policy edge past Belady, never by much
            notes.append(f"at {capacity_blocks} blocks OPT's prefix hit rate is below {', '.join(beaten)}: "
                         "check sim.opt")
    document = {
        "trace": trace,
        "requests": len(requests),
        "accesses": sum(len(r.hash_ids) for r in requests),
        "distinct": distinct_blocks(requests),
        "capacity_blocks": capacity_blocks,
        "ideal_hit_rate": ideal_hit_rate(requests),
        "opt": opt,
        "results": [r.to_json() for r in results],
    }
    return document, notes
