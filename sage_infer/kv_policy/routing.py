"""Which replica serves a request: the fleet's block index and the routing policies.

One code path for the router in front of replicas (`router.fleet`) and anything that replays a
trace through simulated replicas: both feed a `FleetIndex` with each replica's KV events and
ask a `Router` policy for the replica of each request.

`FleetIndex` (`kv_policy.fleet_index`) keeps which replica holds which block in which medium, and
which of a replica's device blocks the requests queued there will have evicted by the time a
newcomer starts.
A replica that names its blocks its own way (a vLLM server: the router renames its blocks from
the token ids its events carry, `router.vllm_events`) has a `naming`, and a request carries its
prompt's hashes under each naming in the fleet.

The ``kv`` policy estimates each replica's time to first token — the requests ahead of it there
times the measured seconds each costs a newcomer, the prompt tokens already queued there, the
prompt tokens it would still compute and the tokens it would load from a lower tier at that
tier's speed, at the measured prefill rate — and picks the minimum. On a replica whose device cache
is full, each token computed again is charged `MISS_CHARGE` times more when choosing: the blocks
it fills evict a prefix that later requests will recompute, which evicts another in turn, so
near saturation a prefix moves only when its replica's queue costs far more than that. Both rates
are learned from
the first tokens the router sees (`Router.learn`): a replica that decodes a crowd is slow for a
newcomer even when the crowd's prompts were all cached, and only measurement says how slow.
The others are there to compare against and for users who want them: ``round-robin``,
``random``, ``least-load`` (fewest requests in flight) and ``session`` (a consistent hash of a
session key: a replica keeps its sessions while the set of live replicas stays the same).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy.fleet_index import DEVICE, LOWER_MEDIA, SHARED, FleetIndex, Hit, Replica
from sage_infer.kv_policy.group_hit import used_keys

__all__ = ["DEVICE", "LOWER_MEDIA", "ROUTING_POLICIES", "SHARED", "FleetIndex", "Hit", "Replica", "Request", "Route",
           "Router"]

ROUTING_POLICIES = ("kv", "round-robin", "random", "least-load", "session")
# prompt tokens computed per second, until the router measured its replicas (only the ratios of the terms below
# decide a kv route; this sets the scale of the predicted TTFT)
DEFAULT_PREFILL_TOKENS_PER_S = 4000.0
# how many times faster than computing it a tier gives a token's KV back (the cost model's measured load speeds
# refine these on a replica; the router only needs their order and rough size)
LOAD_SPEEDUP = {DEVICE: float("inf"), "host": 20.0, "disk": 6.0, SHARED: 3.0}
# seconds one request already in flight at a replica adds to a newcomer's first token, until measured
DEFAULT_SECONDS_PER_REQUEST_AHEAD = 0.008
# on a full device cache, a token computed again is charged this many times more when choosing (not in the predicted
# TTFT): the blocks it fills evict a prefix later requests will recompute; without the charge two replicas near
# saturation trade customers and thrash (both caches full, each move evicts the prefix of the next request)
MISS_CHARGE = 8.0
FULL_SHARE = 0.9  # a device cache holding this share of its capacity (by its events) counts as full
LEARN_WEIGHT = 0.2  # of the newest observation in the learned rates' moving averages
MIN_LEARN_TOKENS = 256  # a first token after fewer computed tokens says too little about the prefill rate
# per routed request, what is left of each replica's recent work: among equal choices the kv policy takes the replica
# that computed least lately, so misses spread by work done and not by turn (requests differ in size)
WORK_DECAY = 0.999


@dataclass(frozen=True, slots=True)
class Route:
    """A policy's choice: the replica, what it expects there (kv), and the replica's load when it was chosen."""

    replica: Replica
    hit: Hit = Hit()
    predicted_ttft_s: float | None = None
    ahead: int = 0  # requests in flight at the replica when this one was routed
    queued_tokens: int = 0  # prompt tokens queued there then
    compute_tokens: int = 0  # prompt tokens this request computes there
    moved: bool = False  # another live replica held more of its blocks (load outweighed the cache)
    tokens_per_block: int = 0  # of the replica's blocks
    blocks: tuple[str, ...] = ()  # the prompt's blocks as the replica names them (kv): held there while in flight


@dataclass(slots=True)
class Request:
    """What a routing policy sees of a request."""

    prompt_tokens: int
    hashes: Sequence[str] = ()  # the prompt's block hashes (kv); empty when not asked for
    tokens_per_block: int = 0
    session: str | None = None  # session: the consistent-hash key
    # the prompt's blocks as replicas of another naming (`Replica.naming`) name them: naming -> (hashes, tokens each)
    named: dict[str, tuple[Sequence[str], int]] = field(default_factory=dict)

    def blocks_for(self, replica: Replica) -> tuple[Sequence[str], int]:
        """The prompt's block hashes as `replica` names its blocks, and the tokens per block."""
        if not replica.naming:
            return self.hashes, self.tokens_per_block
        return self.named.get(replica.naming, ((), 0))


class Router:
    """Picks a live replica for each request by `policy` (one of `ROUTING_POLICIES`)."""

    def __init__(self, index: FleetIndex, policy: str = "kv", seed: int | None = None,
                 prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 seconds_per_request_ahead: float = DEFAULT_SECONDS_PER_REQUEST_AHEAD) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing {policy!r}: expected one of {', '.join(ROUTING_POLICIES)}")
        self.index = index
        self.policy = policy
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.seconds_per_request_ahead = seconds_per_request_ahead
        self._turn = itertools.count()
        self._random = random.Random(seed)

    @property
    def needs_hashes(self) -> bool:
        return self.policy == "kv"

    def route(self, request: Request, exclude: set[str] | frozenset[str] = frozenset()) -> Route | None:
        live = [r for r in self.index.replicas if r.up and r.name not in exclude]
        if not live:
            return None
        if self.policy == "kv":
            return self._by_ttft(request, live)
        if self.policy == "round-robin":
            return Route(live[next(self._turn) % len(live)])
        if self.policy == "random":
            return Route(self._random.choice(live))
        if self.policy == "least-load":
            return Route(min(live, key=lambda r: (r.outstanding, r.queued_tokens)))
        key = request.session if request.session is not None else (request.hashes[0] if request.hashes else "")
        return Route(max(live, key=lambda r: _rendezvous(key, r.name)))

    def _by_ttft(self, request: Request, live: list[Replica]) -> Route:
        """The lowest predicted TTFT; among equals (no hit anywhere, no queue) the replica with the fewest requests
        in flight, then the one that computed least lately, then the emptiest device cache, then the next in turn, so
        new prefixes spread over the fleet by the work they bring."""
        routes, scores = [], []
        for replica in live:
            hashes, tokens_per_block = request.blocks_for(replica)
            needs = replica.group_needs
            hit = self.index.hit(replica, hashes, needs)
            compute = max(0, request.prompt_tokens - hit.blocks * tokens_per_block)
            route = Route(replica, hit, self.predicted_ttft_s(replica, hit, request), replica.outstanding,
                          replica.queued_tokens, compute, tokens_per_block=tokens_per_block,
                          blocks=used_keys(hashes, needs) if needs else tuple(hashes))
            routes.append(route)
            charge = MISS_CHARGE if _full(replica, compute, tokens_per_block, len(needs) or 1) else 0.0
            scores.append(route.predicted_ttft_s + charge * compute / self.prefill_tokens_per_s)
        best = min(scores)
        tied = [r for r, score in zip(routes, scores) if score <= best * (1 + 1e-9)]
        turn = next(self._turn) if len(tied) > 1 else 0
        chosen = min(tied, key=lambda r: (r.replica.outstanding, r.replica.recent_work, len(r.replica.media[DEVICE]),
                                          (live.index(r.replica) - turn) % len(live)))
        for replica in live:
            replica.recent_work *= WORK_DECAY
        chosen.replica.recent_work += chosen.compute_tokens
        self.index.touch(chosen.replica, chosen.blocks)
        most = max(r.hit.blocks for r in routes)
        return dataclasses.replace(chosen, moved=chosen.hit.blocks < most)

    def predicted_ttft_s(self, replica: Replica, hit: Hit, request: Request) -> float:
        """Requests ahead x their measured cost + (prompt tokens queued + computed + loaded) / the prefill rate."""
        _, bs = request.blocks_for(replica)
        load = sum(n * bs / LOAD_SPEEDUP[medium] for medium, n in hit.lower_blocks)
        tokens = replica.queued_tokens + max(0, request.prompt_tokens - hit.blocks * bs) + load
        return replica.outstanding * self.seconds_per_request_ahead + tokens / self.prefill_tokens_per_s

    def learn(self, route: Route, ttft_s: float) -> None:
        """Fold one measured first token into the two rates: alone at its replica with enough to compute, it measures
        the prefill rate; behind others, what each request ahead cost it beyond the tokens it waited for."""
        if ttft_s <= 0:
            return
        if route.ahead == 0 and route.queued_tokens == 0:
            if route.compute_tokens >= MIN_LEARN_TOKENS:
                rate = route.compute_tokens / ttft_s
                self.prefill_tokens_per_s += LEARN_WEIGHT * (rate - self.prefill_tokens_per_s)
            return
        tokens_s = (route.queued_tokens + route.compute_tokens) / self.prefill_tokens_per_s
        per_request = max(0.0, ttft_s - tokens_s) / route.ahead if route.ahead else None
        if per_request is not None:
            self.seconds_per_request_ahead += LEARN_WEIGHT * (per_request - self.seconds_per_request_ahead)


def _full(replica: Replica, compute_tokens: int, tokens_per_block: int, groups: int = 1) -> bool:
    """Whether computing that many tokens there would evict cached blocks (unknown capacity: assume so); a model with
    KV groups fills a block of each group per block of tokens."""
    if replica.capacity_blocks <= 0:
        return True
    needed = -(-compute_tokens // tokens_per_block) * groups if tokens_per_block else 0
    return len(replica.media[DEVICE]) + needed > FULL_SHARE * replica.capacity_blocks


def _rendezvous(key: str, name: str) -> int:
    """Highest-random-weight hashing: the replica a key maps to moves only if that replica leaves."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest(), "big")
