"""Fleet replay: a trace through N simulated replicas behind a routing policy (`sage kv replay --replicas N`).

Each replica is a `TraceCache` — the engine's `KVCacheManager` over its own prefix index and
eviction policy — whose index logs its block events as a serving replica's does; a `FleetIndex`
follows those events and `kv_policy.routing.Router` picks each request's replica: the code
`sage llm router` runs. Time is the trace's: a replica computes the blocks it misses at
`prefill_tokens_per_s`, one request after another, so a request waits for what its replica still
has to compute when it arrives, and its predicted time to first token is that wait plus its own
computation (decoding is not modelled: this measures where prefixes are computed, not end-to-end
latency). The baseline is one replica holding the whole fleet's KV (`replicas=1`, N times the
capacity): what a perfectly shared cache would hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy.base import make_policy
from sage_infer.kv_policy.routing import DEFAULT_PREFILL_TOKENS_PER_S, FleetIndex, Router
from sage_infer.kv_policy.routing import Request as RouteRequest
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.sim.replay import EXTRA_KEY, TraceCache, TraceRequest
from sage_infer.sim.tiered import TRACE_BLOCK_TOKENS


@dataclass(slots=True)
class FleetReplayResult:
    routing: str
    replicas: int
    capacity_blocks: int  # per replica
    policy: str
    requests: int = 0
    accesses: int = 0  # trace blocks looked up
    prefix_hits: int = 0  # blocks each request found cached on its replica
    predicted_hits: int = 0  # blocks the router expected there
    prediction_error: int = 0  # sum of |predicted - found| over requests
    routed: list[int] = field(default_factory=list)  # requests per replica
    computed: list[int] = field(default_factory=list)  # blocks computed per replica
    ttft_s: list[float] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.accesses if self.accesses else 0.0

    @property
    def compute_imbalance(self) -> float:
        """max / mean of the blocks each replica computed: 1.0 is a perfectly even load."""
        mean = sum(self.computed) / len(self.computed) if self.computed else 0.0
        return max(self.computed) / mean if mean else 1.0

    def to_json(self) -> dict:
        ttft = sorted(self.ttft_s)

        def q(p: float) -> float | None:
            return ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else None

        return {"routing": self.routing, "replicas": self.replicas, "capacity_blocks": self.capacity_blocks,
                "policy": self.policy, "requests": self.requests, "accesses": self.accesses,
                "prefix_hit_rate": self.prefix_hit_rate, "compute_imbalance": self.compute_imbalance,
                "routed_imbalance": (max(self.routed) / (sum(self.routed) / len(self.routed))
                                     if self.routed and sum(self.routed) else 1.0),
                "prediction_error": self.prediction_error / self.prefix_hits if self.prefix_hits else 0.0,
                "ttft_s": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}}


def trace_hashes(request: TraceRequest) -> list[str]:
    """The short chained hashes of a request's blocks, as a replica's `TraceCache` names them."""
    hashes, parent = [], None
    for block_id in request.hash_ids:
        parent = hash_block(parent, (block_id,), EXTRA_KEY)
        hashes.append(short(parent))
    return hashes


def replay_fleet(requests: Sequence[TraceRequest], routing: str, replicas: int, capacity_blocks: int,
                 policy: str = "lru", prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 seed: int = 0) -> FleetReplayResult:
    """Route every request of the trace to one of `replicas` caches of `capacity_blocks` each."""
    names = [f"replica-{i}" for i in range(replicas)]
    index = FleetIndex(names)
    router = Router(index, routing, seed, prefill_tokens_per_s)
    caches = [TraceCache(make_policy(policy, capacity=capacity_blocks), capacity_blocks) for _ in names]
    logs = [cache.index.enable_events() for cache in caches]
    for replica in index.replicas:
        replica.capacity_blocks = capacity_blocks
    cursors = [-1] * replicas
    position = {name: i for i, name in enumerate(names)}
    busy_until = [0.0] * replicas
    result = FleetReplayResult(routing, replicas, capacity_blocks, policy, routed=[0] * replicas,
                               computed=[0] * replicas)
    seconds_per_block = TRACE_BLOCK_TOKENS / prefill_tokens_per_s
    for i, request in enumerate(requests):
        now = request.timestamp_ms / 1000.0
        for r, replica in enumerate(index.replicas):
            replica.queued_tokens = max(0.0, busy_until[r] - now) / seconds_per_block * TRACE_BLOCK_TOKENS
        hashes = trace_hashes(request) if router.needs_hashes or routing == "session" else []
        route = router.route(RouteRequest(len(request.hash_ids) * TRACE_BLOCK_TOKENS, hashes, TRACE_BLOCK_TOKENS))
        r = position[route.replica.name]
        cache = caches[r]
        seq, match = cache.begin(i, request)
        hit = len(match.block_ids)
        cache.admit_and_compute(seq, match)
        cache.kv.free(seq)
        computed = len(request.hash_ids) - hit
        busy_until[r] = max(now, busy_until[r]) + computed * seconds_per_block
        result.ttft_s.append(busy_until[r] - now)
        result.requests += 1
        result.accesses += len(request.hash_ids)
        result.prefix_hits += hit
        result.predicted_hits += route.hit.blocks
        result.prediction_error += abs(route.hit.blocks - hit) if router.needs_hashes else 0
        result.routed[r] += 1
        result.computed[r] += computed
        cursors[r] = _follow(index, route.replica, logs[r], cursors[r])
    return result


def _follow(index: FleetIndex, replica, log, cursor: int) -> int:
    """Fold a replica's new events into the fleet index, as the router does with a pushed stream."""
    read = log.read(cursor)
    if read.reset:
        index.reset(replica, read.snapshot)
    for op, medium, block_hash, _, _ in read.events:
        index.apply(replica, op, medium, block_hash)
    return read.next


def run_fleet(requests: Sequence[TraceRequest], trace: str, replica_counts: Sequence[int], routings: Sequence[str],
              capacity_blocks: int, policy: str, prefill_tokens_per_s: float) -> dict:
    """Every (N, routing) pair, next to its baseline: one replica holding N times the capacity."""
    results, baselines = [], {}
    for n in replica_counts:
        baselines[n] = replay_fleet(requests, "round-robin", 1, n * capacity_blocks, policy,
                                    prefill_tokens_per_s).to_json()
        for routing in routings:
            result = replay_fleet(requests, routing, n, capacity_blocks, policy, prefill_tokens_per_s).to_json()
            one = baselines[n]["prefix_hit_rate"]
            result["hit_rate_vs_one_replica"] = result["prefix_hit_rate"] / one if one else None
            results.append(result)
    return {"trace": trace, "requests": len(requests), "capacity_blocks": capacity_blocks, "policy": policy,
            "prefill_tokens_per_s": prefill_tokens_per_s, "block_tokens": TRACE_BLOCK_TOKENS,
            "results": results, "one_replica": {str(n): b for n, b in baselines.items()}}

