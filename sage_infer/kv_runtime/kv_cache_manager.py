"""`KVCacheManager`: the one admission path for KV blocks, used by the engine and the replay alike.

A request's KV goes through four calls, in this order:

1. ``match(seq)``: the longest cached prefix of its tokens. Side-effect free: nothing is
   counted, no policy sees it, so a request that waits for room can be looked up every
   step without skewing metrics or recency.
2. ``admit(seq, match, num_new_tokens)``: take the matched blocks and allocate the rest,
   or change nothing and return False when the pool is short. This is where the query
   is counted (once per prompt) and the eviction policy sees the hit.
3. ``commit(seq)``: after a step computed KV, register newly full blocks for reuse.
4. ``free(seq)``: release its blocks, children before parents.

``allocate`` grows a running sequence; ``on_evict`` is called with the cached blocks an
allocation evicts (one list), before their slots are reused.

Past the device, a prompt's blocks can come from a `KVSource` (`kv_runtime.sources`), given at
construction: the lower tiers (`TierSource`), the blocks a prefill instance sent (`TransferSource`).
`match` asks the source that claims the request for the chain's next blocks, `admit` takes them into
fresh device blocks (the longest verified prefix; the rest is recomputed) and registers them. Every
source hears the device's hits and newly computed blocks, and `promote_hot`, `hold`, `persist`, `poll`
and `close` are the sources' to carry out: the manager names none of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.block_rows import engine_move_threads
from sage_infer.kv_runtime.sources import KVSource
from sage_infer.prefix_reuse.hashing import extend_chain
from sage_infer.prefix_reuse.index import EvictedBlock, PrefixMatch

HOT_PROMOTE_PER_STEP = 8  # blocks promoted ahead of need per step at most

NO_MATCH = PrefixMatch(block_ids=[], block_hashes=[], num_tokens=0)


class KVCacheManager:
    """Sequence-level KV bookkeeping over a `BlockManager` and its prefix index (None: prefix caching off).

    `clock` stamps admissions for time-aware eviction policies (the replay passes trace time). `sources`: where
    prompt blocks past the device come from, in the order they are asked (the first that claims a request
    answers for it); each is attached to `block_manager` here.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        sources: Iterable[KVSource] = (),
    ) -> None:
        self.block_manager = block_manager
        self.index = block_manager.index
        self.block_size = block_manager.block_size
        self.clock = clock
        self.sources: list[KVSource] = list(sources)
        for source in self.sources:
            source.attach(block_manager)
        self.lower_hit_tokens = 0  # prompt tokens first admissions loaded from the lower tiers
        self.in_step_tokens = 0  # prompt tokens admissions took from blocks another sequence computed in their step

    def source(self, name: str) -> KVSource | None:
        """The source called `name` (``tiers``, ``transfers``), or None without one."""
        return next((source for source in self.sources if source.name == name), None)

    # -- prefetch ---------------------------------------------------------------------------

    def prefetch(self, seq: Sequence) -> None:
        """A request entered the waiting queue: start reading its lower-tier prefix now."""
        source = self._source_of(seq)
        if source is not None and source.prefetches and not seq.block_table:
            source.prefetch(seq, self.match(seq))

    def _source_of(self, seq: Sequence) -> KVSource | None:
        return next((source for source in self.sources if source.claims(seq)), None)

    def promote_hot(self, limit: int = HOT_PROMOTE_PER_STEP) -> int:
        """Between steps: the sources bring blocks ahead of need into free device blocks (hot lower-tier
        blocks); at most `limit` each. How many."""
        return sum(source.promote(limit) for source in self.sources)

    def hold(self, seq: Sequence) -> None:
        """A finished sequence whose KV another instance will take: the source that takes it keeps its blocks
        (`TransferSource`, until they are sent); freed at once when none does (nothing to send)."""
        if not any(source.hold(seq) for source in self.sources):
            self.free(seq)

    def poll(self) -> None:
        """Between steps: take what the sources finished in the background (sends and receipts, tier failures)."""
        for source in self.sources:
            source.poll(self.free)

    def is_loading(self, seq: Sequence) -> bool:
        """Its prefix is still on its way (a tier read, a transfer): admit others meanwhile."""
        return any(source.is_loading(seq) for source in self.sources)

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing else to run: sleep until a load or transfer finishes, or `timeout` passes, on the last source
        with something in flight (the builder puts the tiers last: their reads are waited for first, a transfer's
        results are polled at the next step anyway)."""
        for source in reversed(self.sources):
            if source.wait(timeout):
                return

    @property
    def busy(self) -> bool:
        """A source has work in flight that must keep the engine stepping (held or expected transfers)."""
        return any(source.busy for source in self.sources)

    def source_stats(self) -> dict[str, object]:
        """The `EngineStats` fields the sources report (the tiers' state and counters)."""
        stats: dict[str, object] = {}
        for source in self.sources:
            stats.update(source.stats())
        return stats

    # -- the eviction hook ------------------------------------------------------------------

    @property
    def on_evict(self) -> Callable[[list[EvictedBlock]], None] | None:
        return self.block_manager.on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[list[EvictedBlock]], None] | None) -> None:
        self.block_manager.on_evict = hook

    # -- admission ----------------------------------------------------------------------------

    def match(self, seq: Sequence, *, keep_last_token: bool = True) -> PrefixMatch:
        """The longest cached prefix of `seq` in full blocks, token ids verified. Records nothing.

        With `keep_last_token` (the engine) at least one token is left to compute, since its
        logits are needed; the replay matches whole chains.
        """
        if self.index is None or seq.block_table:
            return NO_MATCH
        max_blocks = (seq.num_tokens - 1) // self.block_size if keep_last_token else None
        match = self.index.match(seq.token_ids, seq.extra_key, max_blocks=max_blocks, record=False,
                                 chain=seq.hash_chain)
        source = self._source_of(seq)
        if source is not None:
            source.lookup(seq, match, max_blocks, self.clock())
        return match

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_tokens: int | None = None) -> int:
        """New blocks `seq` needs to hold `num_new_tokens` more tokens than it has computed."""
        computed = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        return max(0, -(-(computed + num_new_tokens) // self.block_size) - len(seq.block_table))

    def can_admit(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int, num_borrowed: int = 0) -> bool:
        """Whether `admit` would succeed (with `num_borrowed` blocks taken in step), without changing anything.

        Matched blocks that are cached now count as available until `admit` takes them, so
        they are subtracted from what the pool can hand out.
        """
        needed = self.blocks_needed(seq, num_new_tokens, match.total_tokens + num_borrowed * self.block_size) \
            - len(match.block_ids) - num_borrowed
        return needed <= 0 or needed <= self.available_after(match)

    def takes_in_step(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Whether `seq` may take blocks another sequence computes in this very step (`admit`'s `borrowed`): prefix
        caching on, and nothing for a source to stage into the blocks after `match` (no lower-tier hit, no
        transfer)."""
        source = self._source_of(seq)
        return self.index is not None and not match.lower_block_hashes and (
            source is None or source.stages_lower_hits_only)

    def lend(self, other: Sequence, match: PrefixMatch, first: int, shared: int) -> tuple | None:
        """The blocks ``first .. shared - 1`` of `other`, which computes them in this step, for a sequence whose cached
        prefix is `match` (its first `first` blocks) to take (`admit`'s `borrowed`, one entry per block); None
        when `other`'s blocks before them are not the ones `match` found."""
        if other.block_table[:first] != list(match.block_ids):
            return None
        return tuple(other.block_table[first:shared])

    def available_after(self, match: PrefixMatch) -> int:
        """Blocks the pool could still hand out once `match`'s blocks are taken (they stop being evictable)."""
        taken = self.index.num_evictable_among(match.block_ids) if match.block_ids else 0
        return self.block_manager.num_available_blocks - taken

    def admit(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int, borrowed: tuple[int, ...] = ()) -> bool:
        """Take `match`'s blocks and allocate room for `num_new_tokens` after them; False, changing nothing, if short.

        `borrowed` (`takes_in_step`): the full blocks of `seq`'s prompt right after `match`'s that another sequence
        computes in this step, same tokens, same key; taken as computed, since a step stores each layer's K/V
        before any row attends. They are registered when that sequence's step is committed (and again, to the
        same blocks, when this one's is). `num_new_tokens` then counts from after them.

        `num_new_tokens` counts from `match.total_tokens`: blocks found in a lower tier are
        loaded here. A load that comes back short (miss, corruption, dead tier) leaves the
        rest to compute: the sequence then needs more steps, never reads wrong KV.
        The prefix query is counted on the sequence's first admission only (a preempted
        sequence coming back is the same prompt), while the policy sees every reuse.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is already admitted")
        if not self.can_admit(seq, match, num_new_tokens, len(borrowed)):
            return False
        if borrowed and not self.takes_in_step(seq, match):
            raise ValueError(f"sequence {seq.seq_id} cannot take blocks computed in its step (takes_in_step)")
        now = self.clock()
        if self.index is not None:
            self.index.policy.tick(now)
            self.index.record_hit(match, count_query=not seq.admitted_once)
            self.block_manager.acquire(match.block_ids)
            for source in self.sources:
                source.on_hit(match)
        source = self._source_of(seq)
        started = time.perf_counter()
        staged = source.take(seq, match, now) if source is not None else None  # before allocating: see TierSource
        taking_s = time.perf_counter() - started  # (allocating below may demote: that is not the load's cost)
        seq.block_table = list(match.block_ids)
        seq.block_hashes = list(match.block_hashes)
        seq.num_computed_tokens = match.num_tokens
        if borrowed:
            self.block_manager.acquire(borrowed)
            seq.block_table.extend(borrowed)
            seq.num_computed_tokens += len(borrowed) * self.block_size
            self.in_step_tokens += len(borrowed) * self.block_size
        # room for what the load returned, not what the lookup promised: a short load's
        # missing blocks are computed by later chunks, which allocate them then
        loaded = staged.shape[0] if staged is not None else 0
        needed = self.blocks_needed(seq, num_new_tokens + loaded * self.block_size)
        if needed:
            seq.block_table.extend(self.block_manager.allocate(needed, seq.extra_key))
        if staged is not None and staged.shape[0]:
            first = len(match.block_ids)
            started = time.perf_counter()
            # written now, or layer by layer as the step's attention reaches each layer (`kv_pool.layer_loads`)
            source.pool.load_rows(seq.block_table[first : first + staged.shape[0]], staged, source.release,
                                  engine_move_threads())
            # the load's own engine time (taking and writing its rows), for load or compute
            source.observe_load(taking_s + time.perf_counter() - started, staged.shape[0])
            seq.num_computed_tokens += staged.shape[0] * self.block_size
            if source.counts_as_lower_hit and not seq.admitted_once:
                self.lower_hit_tokens += staged.shape[0] * self.block_size
            self.commit(seq)  # register the loaded blocks: they are full and their tokens are known
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.admitted_once = True
        return True

    @property
    def num_available_blocks(self) -> int:
        return self.block_manager.num_available_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running `seq`'s block table to hold `num_new_tokens` more; False if the pool is short."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed == 0:
            return True
        if not self.block_manager.can_allocate(needed):
            return False
        seq.block_table.extend(self.block_manager.allocate(needed, seq.extra_key))
        return True

    def persist(self) -> tuple[int, int]:
        """A graceful shutdown: the sources keep what the cache holds for a restart (the tiers copy the device's
        cached blocks and the faster tiers' into the disk tier). (written, left out); (0, 0) when none does."""
        written = left = 0
        for source in self.sources:
            kept, missed = source.persist()
            written, left = written + kept, left + missed
        return written, left

    def close(self) -> None:
        """Stop the sources' background work (the disk tier's writer finishes what it queued; the KV pipe's
        loop and sockets close)."""
        for source in self.sources:
            source.close()

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past `seq`'s computed tokens to the pool: speculative rows the target rejected wrote
        KV there. They were allocated for this step and hold no computed token, so none is registered."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.block_manager.free(list(reversed(seq.block_table[keep:])))
            del seq.block_table[keep:]

    # -- after a step -----------------------------------------------------------------------

    def commit(self, seq: Sequence, token_ids: list[int] | None = None) -> None:
        """After a step computed KV: register newly full blocks so later requests can hit them. `token_ids`: the
        sequence's tokens when its computed ones run past `seq.token_ids` (accepted speculative proposals, which
        are appended after the step's KV is accounted)."""
        bs = self.block_size
        token_ids = seq.token_ids if token_ids is None else token_ids
        full = seq.num_computed_tokens // bs
        first_new = len(seq.block_hashes)
        if self.index is not None:
            chain = extend_chain(seq.hash_chain, token_ids, bs, seq.extra_key, full)
            for i in range(first_new, full):
                parent = seq.block_hashes[i - 1] if i else None
                # a twin computed in the same step may already own this hash: then we move
                # onto its block, so our chain never hangs off an evictable copy
                block_id, block_hash = self.block_manager.cache_block(
                    seq.block_table[i], parent, token_ids[i * bs : (i + 1) * bs], seq.extra_key, chain[i]
                )
                seq.block_table[i] = block_id
                seq.block_hashes.append(block_hash)
            if full > first_new:
                for source in self.sources:
                    source.on_computed(seq.block_hashes[first_new:full], seq.block_table[first_new:full])
        for i in range(max(0, full - 1), len(seq.block_table)):
            filled = min(bs, max(0, seq.num_computed_tokens - i * bs))
            self.block_manager.set_num_tokens(seq.block_table[i], filled)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, children before parents (leaves age first), and any load it had running."""
        for source in self.sources:
            source.forget(seq)
        if seq.block_table:
            self.block_manager.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_hashes = []
