"""The fleet's block index: which replica holds which block (chained prefix hash), in which medium.

`FleetIndex` keeps, per replica, which blocks (short chained prefix hashes, as `/v1/kv/events`
names them) it holds in which medium — device, host, disk — and, for the whole fleet, the
blocks in the shared remote tier, which every replica can load. A prompt's hit on a replica
mirrors what its engine does: the leading blocks on its device, then the blocks right after
them that a lower tier (its own, or the shared one) holds.

It also keeps, per replica, the order in which that replica will have last used its device blocks
(`Replica.recency`): a request routed there touches its prompt's blocks when it starts, and the
requests queued there start in the order they were routed, so the router knows the replica's
least recently used blocks ahead of time. The requests in flight there allocate the blocks they
hold that it has not stored yet; past its capacity each evicts the least recently used block no
request in flight holds (the engine's default `lru` eviction), so a prompt's hit stops at a block
that will be gone by the time it starts. A block a request ahead holds counts as a hit (that
request computes it first) unless `HELD_HORIZON` capacities of other blocks are used after it.
Without the forecast the router counts on blocks the queue ahead evicts: near saturation most of
its predicted hits were misses, each of which evicted another prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy.group_hit import group_hit, group_key
from sage_infer.kv_policy.recency import RecencyOrder

DEVICE, SHARED = "device", "remote"
# a block a request in flight holds counts as a hit until this many times the replica's capacity of other blocks were
# (or will have been, once the requests routed there have started) used after it: LRU's verdict would be 1.0, but
# counting on a prefix a little longer keeps its requests together on one replica, where they find it (in the fleet
# replay of bench/fleet_sim.py 1.5 served the most load within the SLO: 1.0 spreads a prefix's requests and loses
# their hits; much more counts on blocks a long queue evicts)
HELD_HORIZON = 1.5
LOWER_MEDIA = ("host", "disk")  # a replica's own lower tiers, fastest first; "remote" is the fleet's


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
    # a model with KV groups (sliding-window layers): per group the blocks a hit needs (`group_hit.window_needs`)
    group_needs: tuple[int, ...] = ()
    demotes_to: str | None = None  # its fastest lower tier (its snapshot names it), where its device's victims go
    recent_work: float = 0.0  # prompt tokens the kv policy sent here to compute, decayed (`kv_policy.routing`)
    # device blocks (and blocks the requests routed here will compute), least recently used first, as the replica
    # will have used them once the requests routed here have started
    recency: RecencyOrder = field(default_factory=RecencyOrder)
    held: Counter[str] = field(default_factory=Counter)  # blocks of the requests in flight here (never evicted)
    to_allocate: int = 0  # of the held blocks, those not on its device yet: its requests in flight will allocate them

    def take(self, queued_tokens: int, blocks: Sequence[str] = ()) -> None:
        """A request sent here: in flight until it finishes (its `blocks` held by it, never evicted meanwhile), its
        prompt tokens to compute queued until its first token."""
        self.outstanding += 1
        self.queued_tokens += queued_tokens
        device = self.media[DEVICE]
        for block_hash in blocks:
            if not self.held[block_hash]:
                if block_hash in device:
                    self.recency.set_evictable(block_hash, False)
                else:
                    self.to_allocate += 1
            self.held[block_hash] += 1

    def release(self, queued_tokens: int, finished: bool = True, blocks: Sequence[str] = ()) -> None:
        """Its first token came (`finished` False: it still decodes here), or it ended (and lets go of `blocks`)."""
        self.queued_tokens -= queued_tokens
        if not finished:
            return
        self.outstanding -= 1
        device = self.media[DEVICE]
        for block_hash in blocks:
            self.held[block_hash] -= 1
            if self.held[block_hash] <= 0:
                del self.held[block_hash]
                if block_hash in device:
                    self.recency.set_evictable(block_hash, True)
                else:
                    self.to_allocate -= 1

    def stored(self, block_hash: str) -> None:
        """Its device now holds the block."""
        device = self.media[DEVICE]
        if block_hash not in device:
            device.add(block_hash)
            self.recency.add(block_hash, self.keeps)  # one a routed request touched keeps its place
            held = block_hash in self.held
            self.recency.set_evictable(block_hash, not held)
            self.to_allocate -= held

    def removed(self, block_hash: str) -> None:
        """Its device let the block go."""
        device = self.media[DEVICE]
        if block_hash in device:
            device.discard(block_hash)
            self.recency.discard(block_hash)
            self.to_allocate += block_hash in self.held

    def keeps(self, block_hash: str) -> bool:
        """Whether the block's place in `recency` matters: stored here, or held by a request in flight here."""
        return block_hash in self.media[DEVICE] or block_hash in self.held


@dataclass(frozen=True, slots=True)
class Hit:
    """A prompt's blocks a replica would not compute: on its device, then from a lower tier (by medium)."""

    device_blocks: int = 0
    lower_blocks: tuple[tuple[str, int], ...] = ()

    @property
    def blocks(self) -> int:
        return self.device_blocks + sum(n for _, n in self.lower_blocks)


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

    def remove(self, replica: Replica) -> None:
        """Take `replica` out of the fleet, its blocks forgotten."""
        self.drop(replica)
        self.replicas.remove(replica)
        del self._remote[replica.name]

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
        if medium == DEVICE:
            replica.stored(block_hash) if op == "stored" else replica.removed(block_hash)
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
        replica.demotes_to = next((m for m in LOWER_MEDIA if m in snapshot), None)
        # how recently a snapshot's blocks were used is not known: older than whatever is routed from now on

    def drop(self, replica: Replica) -> None:
        """Forget `replica`'s blocks (it died, or will send a fresh snapshot)."""
        for medium, blocks in replica.media.items():
            for block_hash in list(blocks) if medium == DEVICE else ():
                replica.removed(block_hash)
            blocks.clear()
        for block_hash in self._remote[replica.name]:
            self._drop_shared(block_hash)
        self._remote[replica.name] = set()

    def _drop_shared(self, block_hash: str) -> None:
        self.shared[block_hash] -= 1
        if self.shared[block_hash] <= 0:
            del self.shared[block_hash]

    def hit(self, replica: Replica, hashes: Sequence[str], needs: Sequence[int] = ()) -> Hit:
        """The leading blocks of a prompt (its hash chain) on `replica`'s device or that a request in flight there
        computes first, and not `doomed` by the time it starts; then the ones right after them a lower tier holds —
        its own host or disk, or the shared remote tier. With `needs` (a model with KV groups: `group_hit`), the
        longest prefix whose every group holds the blocks a hit needs on the device."""
        device, held = replica.media[DEVICE], replica.held
        if needs:
            threshold = self.doomed_before(replica)

            def where(group: int, i: int) -> str | None:
                key = group_key(hashes[i], group)
                if (key in device or key in held) and not (threshold and self._lost(replica, key, threshold)):
                    return DEVICE
                return self._below(replica, key)

            length, lower = group_hit(where, len(hashes), needs, DEVICE)
            return Hit(length - sum(n for _, n in lower), lower)
        n = 0
        while n < len(hashes) and (hashes[n] in device or hashes[n] in held):
            n += 1
        if n and (threshold := self.doomed_before(replica)):  # the forecast costs only where there is a hit to cut
            n = next((i for i in range(n) if self._lost(replica, hashes[i], threshold)), n)
        lower: list[tuple[str, int]] = []
        for block_hash in hashes[n:]:
            medium = self._below(replica, block_hash)
            if medium is None:
                break
            if lower and lower[-1][0] == medium:
                lower[-1] = (medium, lower[-1][1] + 1)
            else:
                lower.append((medium, 1))
        return Hit(n, tuple(lower))

    def _below(self, replica: Replica, block_hash: str) -> str | None:
        """The medium below `replica`'s device a block comes back from: its own host or disk, the shared remote tier,
        or (a device block evicted before the request's turn) the tier its device demotes to; None: nowhere."""
        medium = next((m for m in LOWER_MEDIA if block_hash in replica.media.get(m, ())), None)
        if medium is None and block_hash in self.shared:
            medium = SHARED
        if medium is None and block_hash in replica.media[DEVICE]:  # evicted before its turn: demoted below
            medium = replica.demotes_to
        return medium

    def blocks_in(self, replica: Replica, medium: str) -> int:
        return len(self._remote[replica.name]) if medium == SHARED else len(replica.media.get(medium, ()))

    def touch(self, replica: Replica, hashes: Sequence[str]) -> None:
        """A request with these blocks was routed to `replica`: once it starts they are its most recently used."""
        for block_hash in hashes:
            replica.recency.touch(block_hash, replica.keeps)

    def doomed_before(self, replica: Replica) -> int:
        """The stamp (in `replica.recency`) at or before which its device blocks will have been evicted by the time a
        request routed now starts; 0: none. Its requests in flight allocate the blocks they hold that it has not
        stored yet, and past its capacity each evicts the least recently used (in `recency`'s order, the order the
        replica starts its requests) of the blocks no request in flight there holds."""
        evicted = len(replica.media[DEVICE]) + replica.to_allocate - replica.capacity_blocks
        if replica.capacity_blocks <= 0 or evicted <= 0:
            return 0
        return replica.recency.oldest_evictable_stamp(evicted)

    def _lost(self, replica: Replica, block_hash: str, threshold: int) -> bool:
        """Whether a block of a prompt's hit will be gone when the request starts: an evictable one among the
        `doomed_before` oldest; one a request in flight holds (it computes or uses it first) once `HELD_HORIZON`
        capacities of other blocks were used after it."""
        recency = replica.recency
        if block_hash in replica.held:
            return block_hash in recency and recency.newer_than(block_hash) >= HELD_HORIZON * replica.capacity_blocks
        return recency.among_oldest(block_hash, threshold)

    def doomed(self, replica: Replica) -> frozenset[str]:
        """The device blocks `doomed_before` counts as evicted (for tests and tools; routing asks per block)."""
        threshold = self.doomed_before(replica)
        return frozenset(h for h in replica.media[DEVICE] if replica.recency.among_oldest(h, threshold))
