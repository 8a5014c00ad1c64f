"""Fleet replay: a trace through N simulated replicas behind a routing policy (`sage kv replay --replicas N`).

Each replica is a `TraceCache` — the engine's `KVCacheManager` over its own prefix index and
eviction policy — whose index logs its block events as a serving replica's does; a `FleetIndex`
follows those events and `kv_policy.routing.Router` picks each request's replica: the code
`sage llm router` runs. Time is the trace's: a replica computes the blocks it misses at
`prefill_tokens_per_s`, one request after another in the order they were routed to it, and a request
looks its prompt up in the cache when it starts — so blocks the router counted on may have been
evicted by the requests queued ahead of it, as on a serving replica. Its time to first token is its
wait plus its own computation (decoding is not modelled: this measures where prefixes are computed, not end-to-end
latency). The baseline is one replica holding the whole fleet's KV (`replicas=1`, N times the
capacity): what a perfectly shared cache would hit.
"""

from __future__ import annotations

from collections import deque
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


@dataclass(slots=True)
class _Queued:
    """A request routed to a replica and not started there yet."""

    i: int
    request: TraceRequest
    arrival: float
    predicted_blocks: int | None  # the blocks the kv policy expected cached there (None: another policy)
    predicted_compute: int  # prompt tokens the router expects it to compute there (its queued-tokens count)
    blocks: tuple[str, ...]  # held at the replica (by the router's count) until it ends


class _SimReplica:
    """One simulated replica: its cache, the requests waiting for it (first come, first served) and when it is free.
    A request looks its prompt up when it starts, not when it is routed: blocks the router saw may be gone by then,
    evicted by the requests ahead of it, as on a serving replica."""

    def __init__(self, capacity_blocks: int, policy: str) -> None:
        self.cache = TraceCache(make_policy(policy, capacity=capacity_blocks), capacity_blocks)
        self.log = self.cache.index.enable_events()
        self.cursor = -1
        self.waiting: deque[_Queued] = deque()
        self.free_at = 0.0
        self.running: _Queued | None = None  # started, first token at free_at
        self.running_seq = None  # its sequence in the cache, holding its blocks until then


def replay_fleet(requests: Sequence[TraceRequest], routing: str, replicas: int, capacity_blocks: int,
                 policy: str = "lru", prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 seed: int = 0) -> FleetReplayResult:
    """Route every request of the trace to one of `replicas` caches of `capacity_blocks` each, in the trace's time."""
    names = [f"replica-{i}" for i in range(replicas)]
    index = FleetIndex(names)
    router = Router(index, routing, seed, prefill_tokens_per_s)
    sims = [_SimReplica(capacity_blocks, policy) for _ in names]
    for replica in index.replicas:
        replica.capacity_blocks = capacity_blocks
    position = {name: i for i, name in enumerate(names)}
    result = FleetReplayResult(routing, replicas, capacity_blocks, policy, routed=[0] * replicas,
                               computed=[0] * replicas)
    seconds_per_block = TRACE_BLOCK_TOKENS / prefill_tokens_per_s
    for i, request in enumerate(requests):
        now = request.timestamp_ms / 1000.0
        for r, replica in enumerate(index.replicas):
            _run_until(index, replica, sims[r], now, seconds_per_block, result, r)
        hashes = trace_hashes(request) if router.needs_hashes or routing == "session" else []
        route = router.route(RouteRequest(len(request.hash_ids) * TRACE_BLOCK_TOKENS, hashes, TRACE_BLOCK_TOKENS))
        r = position[route.replica.name]
        route.replica.take(route.compute_tokens, route.blocks)
        predicted = route.hit.blocks if router.needs_hashes else None
        sims[r].waiting.append(_Queued(i, request, now, predicted, route.compute_tokens, route.blocks))
        result.routed[r] += 1
    for r, replica in enumerate(index.replicas):
        _run_until(index, replica, sims[r], float("inf"), seconds_per_block, result, r)
    return result


def _run_until(index: FleetIndex, replica, sim: _SimReplica, now: float, seconds_per_block: float,
               result: FleetReplayResult, r: int) -> None:
    """Start, in order, the requests `sim` starts by `now`; each first token releases its router count."""
    while True:
        if sim.running is not None and sim.free_at <= now:
            sim.cache.kv.free(sim.running_seq)  # its blocks were held while it ran
            replica.release(sim.running.predicted_compute, blocks=sim.running.blocks)
            sim.running = None
        if sim.running is not None or not sim.waiting or max(sim.free_at, sim.waiting[0].arrival) > now:
            return
        queued = sim.waiting.popleft()
        start = max(sim.free_at, queued.arrival)
        seq, match = sim.cache.begin(queued.i, queued.request)
        sim.cache.now = start
        hit = len(match.block_ids)
        sim.cache.admit_and_compute(seq, match)
        computed = len(queued.request.hash_ids) - hit
        sim.free_at = start + computed * seconds_per_block
        sim.running, sim.running_seq = queued, seq
        result.ttft_s.append(sim.free_at - queued.arrival)
        result.requests += 1
        result.accesses += len(queued.request.hash_ids)
        result.prefix_hits += hit
        if queued.predicted_blocks is not None:
            result.predicted_hits += queued.predicted_blocks
            result.prediction_error += abs(queued.predicted_blocks - hit)
        result.computed[r] += computed
        sim.cursor = _follow(index, replica, sim.log, sim.cursor)


def _follow(index: FleetIndex, replica, log, cursor: int) -> int:
    """Fold a replica's new events into the fleet index, as the router does with a pushed stream."""
    read = log.read(cursor)
    if read.reset:
        index.reset(replica, read.snapshot)
    for op, medium, block_hash, *_ in read.events:
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

