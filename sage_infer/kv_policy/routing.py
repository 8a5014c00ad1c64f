"""Which replica serves a request: the fleet's block index and the routing policies.

One code path for the router in front of replicas (`router.fleet`) and anything that replays a
trace through simulated replicas: both feed a `FleetIndex` with each replica's KV events and
ask a `Router` policy for the replica of each request.

`FleetIndex` keeps, per replica, which blocks (short chained prefix hashes, as `/v1/kv/events`
names them) it holds in which medium — device, host, disk — and, for the whole fleet, the
blocks in the shared remote tier, which every replica can load. A prompt's hit on a replica
mirrors what its engine does: the leading blocks on its device, then the blocks right after
them that a lower tier (its own, or the shared one) holds.
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
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

DEVICE, SHARED = "device", "remote"
LOWER_MEDIA = ("host", "disk")  # a replica's own lower tiers, fastest first; "remote" is the fleet's
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


@dataclass(slots=True)
class Replica:
    """What the fleet knows of one replica: its blocks per medium (from its events) and its load."""

    name: str
    media: dict[str, set[str]] = field(default_factory=lambda: {DEVICE: set(), "host": set(), "disk": set()})
    up: bool = True
    outstanding: int = 0  # requests routed here and not finished
    queued_tokens: int = 0  # prompt tokens routed here whose first token has not come yet (the router's count)
    capacity_blocks: int = 0  # its device pool, as it reported (0: not known)
    naming: str = ""  # how its blocks are named: "" as the request's `hashes`, else a key of `Request.named`
    recent_work: float = 0.0  # prompt tokens the kv policy sent here to compute, decayed (`WORK_DECAY`)

    def take(self, queued_tokens: int) -> None:
        """A request sent here: in flight until it finishes, its prompt tokens to compute queued until its first
        token."""
        self.outstanding += 1
        self.queued_tokens += queued_tokens

    def release(self, queued_tokens: int, finished: bool = True) -> None:
        """Its first token came (`finished` False: it still decodes here), or it ended."""
        self.queued_tokens -= queued_tokens
        if finished:
            self.outstanding -= 1


@dataclass(frozen=True, slots=True)
class Hit:
    """A prompt's blocks a replica would not compute: on its device, then from a lower tier (by medium)."""

    device_blocks: int = 0
    lower_blocks: tuple[tuple[str, int], ...] = ()

    @property
    def blocks(self) -> int:
        return self.device_blocks + sum(n for _, n in self.lower_blocks)


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


class FleetIndex:
    """Block hash -> which replicas hold it, in which medium; the shared remote tier counted once for all."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.replicas: list[Replica] = [Replica(n) for n in names]
        self.shared: Counter[str] = Counter()  # remote-tier hash -> replicas that report it stored
        self._remote: dict[str, set[str]] = {n: set() for n in names}  # what each replica reported in the remote tier

    def add(self, name: str) -> Replica:
        replica = Replica(name)
        self.replicas.append(replica)
        self._remote[name] = set()
        return replica

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def apply(self, replica: Replica, op: str, medium: str, block_hash: str) -> None:
        """One event: ``stored`` or ``removed`` of `block_hash` in `medium` (device, host, disk, remote)."""
        if medium == SHARED:
            mine = self._remote[replica.name]
            if op == "stored" and block_hash not in mine:
                mine.add(block_hash)
                self.shared[block_hash] += 1
            elif op == "removed" and block_hash in mine:
                mine.discard(block_hash)
                self._drop_shared(block_hash)
            return
        blocks = replica.media.setdefault(medium, set())
        if op == "stored":
            blocks.add(block_hash)
        else:
            blocks.discard(block_hash)

    def reset(self, replica: Replica, snapshot: dict[str, list[str]]) -> None:
        """Replace all that is known of `replica` by its snapshot (medium -> hashes)."""
        self.drop(replica)
        for medium, hashes in snapshot.items():
            for block_hash in hashes:
                self.apply(replica, "stored", medium, block_hash)

    def drop(self, replica: Replica) -> None:
        """Forget `replica`'s blocks (it died, or will send a fresh snapshot)."""
        for blocks in replica.media.values():
            blocks.clear()
        for block_hash in self._remote[replica.name]:
            self._drop_shared(block_hash)
        self._remote[replica.name] = set()

    def _drop_shared(self, block_hash: str) -> None:
        self.shared[block_hash] -= 1
        if self.shared[block_hash] <= 0:
            del self.shared[block_hash]

    def hit(self, replica: Replica, hashes: Sequence[str]) -> Hit:
        """The leading blocks of a prompt (its hash chain) on `replica`'s device, then the ones right after them a
        lower tier holds — its own host or disk, or the shared remote tier."""
        device = replica.media[DEVICE]
        n = 0
        while n < len(hashes) and hashes[n] in device:
            n += 1
        lower: list[tuple[str, int]] = []
        for block_hash in hashes[n:]:
            medium = next((m for m in LOWER_MEDIA if block_hash in replica.media.get(m, ())), None)
            if medium is None and block_hash in self.shared:
                medium = SHARED
            if medium is None:
                break
            if lower and lower[-1][0] == medium:
                lower[-1] = (medium, lower[-1][1] + 1)
            else:
                lower.append((medium, 1))
        return Hit(n, tuple(lower))

    def blocks_in(self, replica: Replica, medium: str) -> int:
        return len(self._remote[replica.name]) if medium == SHARED else len(replica.media.get(medium, ()))


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
            hit = self.index.hit(replica, hashes)
            compute = max(0, request.prompt_tokens - hit.blocks * tokens_per_block)
            route = Route(replica, hit, self.predicted_ttft_s(replica, hit, request), replica.outstanding,
                          replica.queued_tokens, compute, tokens_per_block=tokens_per_block)
            routes.append(route)
            charge = MISS_CHARGE if _full(replica, compute, tokens_per_block) else 0.0
            scores.append(route.predicted_ttft_s + charge * compute / self.prefill_tokens_per_s)
        best = min(scores)
        tied = [r for r, score in zip(routes, scores) if score <= best * (1 + 1e-9)]
        turn = next(self._turn) if len(tied) > 1 else 0
        chosen = min(tied, key=lambda r: (r.replica.outstanding, r.replica.recent_work, len(r.replica.media[DEVICE]),
                                          (live.index(r.replica) - turn) % len(live)))
        for replica in live:
            replica.recent_work *= WORK_DECAY
        chosen.replica.recent_work += chosen.compute_tokens
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


def _full(replica: Replica, compute_tokens: int, tokens_per_block: int) -> bool:
    """Whether computing that many tokens there would evict cached blocks (unknown capacity: assume so)."""
    if replica.capacity_blocks <= 0:
        return True
    needed = -(-compute_tokens // tokens_per_block) if tokens_per_block else 0
    return len(replica.media[DEVICE]) + needed > FULL_SHARE * replica.capacity_blocks


def _rendezvous(key: str, name: str) -> int:
    """Highest-random-weight hashing: the replica a key maps to moves only if that replica leaves."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest(), "big")
