"""`GroupKVCacheManager`: the `KVCacheManager` of a model with sliding-window layers, one block table per KV group.

After vLLM's hybrid allocator (`KVCacheCoordinator` over a `FullAttentionManager` / `SlidingWindowManager` per group):

- **Tables**: every group has a table of the same length per sequence (`tables`): group 0's is `seq.block_table`, the
  others live here, by sequence id. A sliding group's entries wholly before the window are the null block, which is
  held for ever and never written or read (the pool's zeros).
- **Freeing out of the window**: `commit` registers newly full blocks, then gives a sliding group's blocks wholly
  before ``num_computed_tokens - W + 1`` back to the pool (cached, evictable, when prefix caching is on): between
  steps a sequence holds about ``W + block_size`` tokens in such a group. Only committed tokens count, so a
  speculative rollback (`trim`) never needs a freed block.
- **Prefix hits per group** (`sage_infer.kv_runtime.group_prefix`): every full group's blocks of the prefix and
  only the last ``ceil((W - 1) / block_size)`` of a sliding group's; `commit` registers each group's blocks under
  the keys `GroupPrefix` looks them up by, and, when the index logs events for routers, names each one by its
  chained prefix hash and group first (`BlockEvents.name`), the name a router hashes a prompt to.

- **Lower tiers** (`sage_infer.kv_runtime.group_tiers`): evicted blocks of every group are demoted as the plain
  path's are; a hit takes each group's blocks from the device or the tiers, block by block, loading only what the
  hit needs (the full groups' prefix, a sliding group's window). A load that comes back short (a miss, a corrupt
  block, a dead store) falls back to the longest prefix every group still serves (at least the device's own hit).

- **Prefill/decode transfers** (`sage_infer.kv_runtime.group_transfers`): a prefill worker sends every full group's
  blocks of the prompt and a window per sliding group, the blocks the decode worker's hit takes; a held sequence's
  sliding groups free none of them. The decode worker takes them as it takes a tier load (`GroupTransferSource`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.block_rows import engine_move_threads
from sage_infer.kv_runtime.group_prefix import LOAD, GroupMatch, GroupPrefix
from sage_infer.kv_runtime.group_tiers import GroupTierSource
from sage_infer.kv_runtime.group_transfers import GroupTransferSource, first_sent
from sage_infer.kv_runtime.kv_cache_manager import NO_MATCH, KVCacheManager
from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.kv_runtime.sources import KVSource
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.prefix_reuse.index import PrefixMatch

NOT_FOR_GROUPS = "not implemented yet for hybrid KV groups"


class GroupKVCacheManager(KVCacheManager):
    """Sequence-level KV bookkeeping for `groups` (a model with some sliding-window layer) over one `BlockManager`.
    The calls and their order are `KVCacheManager`'s; every count is in blocks of all groups together."""

    def __init__(self, block_manager: BlockManager, groups: KVGroups,
                 clock: Callable[[], float] = time.monotonic, sources: Iterable[KVSource] = ()) -> None:
        sources = list(sources)
        for source in sources:
            if not isinstance(source, (GroupTierSource, GroupTransferSource)):
                raise NotImplementedError(f"KV source {source.name!r}: {NOT_FOR_GROUPS}")
        super().__init__(block_manager, clock, sources)
        self.groups = groups
        self.windows = [group.window for group in groups.groups]
        self.num_groups = len(self.windows)
        self.tree = self.windows[0] is None  # group 0 keeps the prefix tree of the plain path
        self.null_block = block_manager.allocate(1)[0]  # never freed: what a table holds out of a window
        self.prefix = GroupPrefix(self.index, groups, self.block_size, self.null_block) \
            if self.index is not None else None
        if self.index is not None and self.index.quota is not None:  # (tiers share it): a group's keys say more
            self.index.quota.tenant_of = GroupPrefix.tenant
        self._tables: dict[int, list[list[int]]] = {}  # seq id -> the tables of groups 1..
        self._freed: dict[int, list[int]] = {}  # seq id -> per group: its leading entries that are the null block
        for source in sources:
            source.prefix = self.prefix
            if isinstance(source, GroupTransferSource):  # a send reads a held sequence's tables
                source.transfers.tables, source.transfers.null_block = self.tables, self.null_block

    def tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block table of every group (equal lengths; group 0's is `seq.block_table`)."""
        extra = self._tables.get(seq.seq_id)
        if extra is None and self.num_groups > 1 and seq.block_table:  # (a table made outside this manager)
            raise NotImplementedError(f"sequence {seq.seq_id} has one block table, not one per KV group: "
                                      f"blocks taken outside the KV manager are {NOT_FOR_GROUPS}")
        return [seq.block_table, *(extra or ())]

    def held_blocks(self, seq: Sequence) -> list[int]:
        """Blocks `seq` holds in each group now (its table less the null entries)."""
        return [sum(1 for block in table if block != self.null_block) for table in self.tables(seq)]

    def max_tokens_alone(self, chunk_tokens: int) -> int | None:
        """The most tokens one sequence can reach with the pool to itself; None when the pool bounds none (every
        group slides and its window with a step's chunk of `chunk_tokens` fits)."""
        bs = self.block_size
        blocks = self.block_manager.num_blocks - 1  # less the null block
        full = self.windows.count(None)
        peak = sum(self.groups.window_blocks(group, bs) + 2 + -(-chunk_tokens // bs)
                   for group, window in enumerate(self.windows) if window is not None)
        every = blocks // self.num_groups * bs  # nothing freed
        if full == 0:
            return None if peak <= blocks else every
        return max(every, (blocks - peak) // full * bs)

    # -- prefix hits (`GroupPrefix`) ----------------------------------------------------------

    def match(self, seq: Sequence, *, keep_last_token: bool = True) -> PrefixMatch:
        """The longest prefix every group serves from the cache, in full blocks. Records nothing."""
        if self.prefix is None or seq.block_table:
            return NO_MATCH
        limit = (seq.num_tokens - 1 if keep_last_token else seq.num_tokens) // self.block_size
        match = self.prefix.match(seq, limit)
        source = self._source_of(seq) if self.sources else None
        if source is not None:
            source.lookup(seq, match, limit, self.clock())
        return match

    def _probe(self, token_ids: list[int], extra_key: bytes) -> PrefixMatch:
        """The device's hit alone (a probe from another thread never asks the tiers)."""
        if self.prefix is None:
            return NO_MATCH
        probe = Sequence(-1, "", 0, list(token_ids), len(token_ids), SamplingParams(), extra_key)
        return self.prefix.match(probe, len(token_ids) // self.block_size)

    def overlap(self, token_ids: list[int], extra_key: bytes) -> int:
        """Leading tokens of `token_ids` a prefix hit would serve now (every group); records nothing (dict reads
        only: safe from another thread, the answer possibly stale)."""
        return self._probe(token_ids, extra_key).num_tokens

    def cached_hashes(self, token_ids: list[int], extra_key: bytes) -> list[bytes]:
        """The index hashes of the blocks a prefix hit on `token_ids` would take now, every group's (what a session
        retains for its next turn)."""
        match = self._probe(token_ids, extra_key)
        blocks = [b for ids in getattr(match, "group_block_ids", ()) for b in ids if b != self.null_block]
        return [self.index.hash_of(block) for block in blocks]

    # -- admission ----------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_tokens: int | None = None) -> int:
        """New blocks, all groups together, `seq` needs to hold `num_new_tokens` more tokens than it has computed."""
        return super().blocks_needed(seq, num_new_tokens, num_computed_tokens) * self.num_groups

    def can_admit(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int, num_borrowed: int = 0) -> bool:
        plan = getattr(match, "plan", None)
        if plan is None:
            matched = self.num_groups * (match.num_tokens // self.block_size + num_borrowed)
        else:  # a hit's entries that need no new block: the device's and the null ones
            length, matched = match.total_tokens // self.block_size, 0
            for group, table in enumerate(plan):
                first = self.prefix.first_needed(group, length)
                matched += first + sum(b != LOAD for b in table[first:])
        needed = self.blocks_needed(seq, num_new_tokens, match.total_tokens + num_borrowed * self.block_size) - matched
        return needed <= 0 or needed <= self.available_after(match)

    def available_after(self, match: PrefixMatch) -> int:
        taken = self._device_blocks(getattr(match, "plan", None) or getattr(match, "group_block_ids", ()))
        return self.block_manager.num_available_blocks - (self.index.num_evictable_among(taken) if taken else 0)

    def _device_blocks(self, tables: list[list[int]]) -> list[int]:
        return [b for table in tables for b in table if b != self.null_block and b != LOAD]

    def takes_in_step(self, seq: Sequence, match: PrefixMatch) -> bool:
        """`KVCacheManager.takes_in_step`, and no lower-tier plan (a hit that loads takes its blocks from below)."""
        return super().takes_in_step(seq, match) and getattr(match, "plan", None) is None

    def lend(self, other: Sequence, match: PrefixMatch, first: int, shared: int) -> tuple | None:
        """Every group's blocks ``first .. shared - 1`` of `other` (one tuple of group blocks per position): a
        sliding group's too, all of them (those that fall out of the taker's window are freed at its first
        commit); None when `other`'s blocks before them are not the ones `match` found where `match` needs one."""
        tables = self.tables(other)
        wanted = getattr(match, "group_block_ids", None) or [[] for _ in tables]
        for table, ids in zip(tables, wanted):
            if any(block != self.null_block and block != table[i] for i, block in enumerate(ids[:first])):
                return None
        return tuple(zip(*(table[first:shared] for table in tables)))

    def admit(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int, borrowed: tuple = ()) -> bool:
        """`KVCacheManager.admit` for every group: take each group's matched blocks, then those `borrowed` (`lend`:
        per position, every group's block another sequence computes in this step), then room for `num_new_tokens`
        after them in every table; False, changing nothing, if short."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is already admitted")
        if not self.can_admit(seq, match, num_new_tokens, len(borrowed)):
            return False
        if borrowed and not self.takes_in_step(seq, match):
            raise ValueError(f"sequence {seq.seq_id} cannot take blocks computed in its step (takes_in_step)")
        if getattr(match, "plan", None) is not None:
            self._admit_below(seq, match, num_new_tokens)
            return True
        tables = [list(ids) for ids in match.group_block_ids] if match.num_tokens else \
            [[] for _ in range(self.num_groups)]
        if self.index is not None:
            self.index.policy.tick(self.clock())
            if not seq.admitted_once:
                self.index.metrics.record(match.num_query_blocks, len(match.block_ids), self.block_size)
            taken = [b for table in tables for b in table if b != self.null_block]
            for block in reversed(taken):
                self.index.policy.on_hit(self.index.hash_of(block))
            self.block_manager.acquire(taken)
            source = self._source_of(seq) if self.sources else None
            if source is not None:  # the device's hit alone: the tiers count it (and what they declined to load)
                source.on_device_hit([self.index.hash_of(block) for block in taken], taken)
                source.release(source.take(seq, match, self.clock()))
        if borrowed:
            self.block_manager.acquire([block for blocks in borrowed for block in blocks])
            for table, blocks in zip(tables, zip(*borrowed)):
                table.extend(blocks)
            self.in_step_tokens += len(borrowed) * self.block_size
        seq.block_table = tables[0]
        self._tables[seq.seq_id] = tables[1:]
        if self.prefix is not None:
            self.prefix.forget(seq)
        self._freed[seq.seq_id] = [table.count(self.null_block) for table in tables]
        seq.block_hashes = list(match.block_hashes)
        seq.num_computed_tokens = match.num_tokens + len(borrowed) * self.block_size
        self._grow(seq, num_new_tokens)
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.admitted_once = True
        return True

    def _admit_below(self, seq: Sequence, match: GroupMatch, num_new_tokens: int) -> None:
        """`admit` of a hit that loads blocks from the tiers: take the plan's device blocks, read the lower ones
        (before allocating: the evictions that causes never push out a block being loaded), keep the longest prefix
        every group serves with what came back, write the loaded rows into fresh blocks and register them. Rows a
        short load brought past that prefix are dropped (they left the tiers: recomputed when next needed)."""
        now = self.clock()
        self.index.policy.tick(now)
        if not seq.admitted_once:
            self.index.metrics.record(match.num_query_blocks, len(match.block_ids), self.block_size)
        self.block_manager.acquire(self._device_blocks(match.plan))
        source = self._source_of(seq)
        rows = source.take(seq, match, now)
        loaded = {slot: row for row, slot in enumerate(match.lower_slots[: rows.shape[0] if rows is not None else 0])}
        tables, length = self._kept_tables(match.plan, loaded)
        kept = self._device_blocks(tables)  # (before the loaded blocks join them: those register at `commit`)
        slots = [(group, i) for group, table in enumerate(tables) for i in range(len(table)) if table[i] == LOAD]
        if slots:
            fresh = self.block_manager.allocate(len(slots), seq.extra_key)
            picked = [loaded[slot] for slot in slots]
            source.pool.write_rows(fresh, rows if picked == list(range(rows.shape[0])) else rows[picked],
                                   engine_move_threads())
            for (group, i), block in zip(slots, fresh):
                tables[group][i] = block
        source.release(rows)
        for block in reversed(kept):
            self.index.policy.on_hit(self.index.hash_of(block))
        source.on_device_hit([self.index.hash_of(block) for block in kept], kept)
        seq.block_table = tables[0]
        self._tables[seq.seq_id] = tables[1:]
        self.prefix.forget(seq)
        self._freed[seq.seq_id] = [table.count(self.null_block) for table in tables]
        first_loaded = min((i for _, i in slots), default=length)
        seq.block_hashes = list(match.chain[:first_loaded])  # `commit` registers the loaded blocks from there
        seq.num_computed_tokens = length * self.block_size
        if source.counts_as_lower_hit and not seq.admitted_once and length * self.block_size > match.num_tokens:
            self.lower_hit_tokens += length * self.block_size - match.num_tokens
        self._grow(seq, num_new_tokens)
        self.commit(seq)
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.admitted_once = True

    def _kept_tables(self, plan: list[list[int]], loaded: dict[tuple[int, int], int]) -> tuple[list[list[int]], int]:
        """The tables of the longest prefix every group serves from `plan`'s device blocks and the `loaded` slots
        ((group, position) -> row), and its length in blocks; the plan's device blocks left out are released (the
        `LOAD` entries kept are the loaded ones)."""
        def there(group: int, i: int) -> bool:
            table = plan[group]
            return i < len(table) and (table[i] != LOAD and table[i] != self.null_block or (group, i) in loaded)

        length = self.prefix.agreed(len(plan[0]), lambda group, n: self.prefix.served(
            group, n, lambda i: there(group, i)))
        tables, released = [], []
        for group, table in enumerate(plan):
            first = self.prefix.first_needed(group, length)
            released += [b for b in table[:first] + table[length:] if b != LOAD and b != self.null_block]
            tables.append([self.null_block] * first + table[first:length])
        if released:
            self.block_manager.free(list(reversed(released)))
        return tables, length

    def _grow(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = super().blocks_needed(seq, num_new_tokens)
        if needed:
            for table in self.tables(seq):
                table.extend(self.block_manager.allocate(needed, seq.extra_key))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running `seq`'s tables to hold `num_new_tokens` more; False if the pool is short."""
        if not self.block_manager.can_allocate(self.blocks_needed(seq, num_new_tokens)):
            return False
        self._grow(seq, num_new_tokens)
        return True

    def trim(self, seq: Sequence) -> None:
        """Every group's blocks past `seq`'s computed tokens back to the pool (rejected speculative rows)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        for table in self.tables(seq):
            if len(table) > keep:
                self.block_manager.free(list(reversed(table[keep:])))
                del table[keep:]

    # -- after a step -------------------------------------------------------------------------

    def commit(self, seq: Sequence, token_ids: list[int] | None = None) -> None:
        """Register every group's newly full blocks, then free the sliding groups' blocks out of the window."""
        bs, manager, null = self.block_size, self.block_manager, self.null_block
        token_ids = seq.token_ids if token_ids is None else token_ids
        full = seq.num_computed_tokens // bs
        tables = self.tables(seq)
        if self.index is not None:
            events = self.index.events  # a router's log names each group's block by the chain hash (`BlockEvents.name`)
            added: list[tuple[bytes, int]] = []  # (key, block) of every group's newly full blocks, for the tiers
            for i in range(len(seq.block_hashes), full):
                before = seq.block_hashes[i - 1] if i else None
                tokens = token_ids[i * bs : (i + 1) * bs]
                chain = None if self.tree else hash_block(before, tokens, seq.extra_key)  # (the tree's: below)
                for group, table in enumerate(tables):
                    if table[i] == null:
                        continue
                    if group == 0 and self.tree:  # the chain of the plain path
                        table[i], chain = manager.cache_block(table[i], before, tokens, seq.extra_key)
                        added.append((chain, table[i]))
                    else:
                        key = GroupPrefix.key(seq.extra_key, group, before)
                        if events is not None:
                            events.name(hash_block(None, tokens, key), chain, before, group)
                        table[i], key = manager.cache_block(table[i], None, tokens, key)
                        added.append((key, table[i]))
                seq.block_hashes.append(chain)
            if added and self.sources:
                for source in self.sources:
                    source.on_computed([key for key, _ in added], [block for _, block in added])
        for table in tables:
            for i in range(max(0, full - 1), len(table)):
                if table[i] != null:
                    manager.set_num_tokens(table[i], min(bs, max(0, seq.num_computed_tokens - i * bs)))
        self._free_window(seq, tables)

    def _free_window(self, seq: Sequence, tables: list[list[int]]) -> None:
        freed = self._freed.get(seq.seq_id)
        if freed is None:
            return
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            end = max(0, seq.num_computed_tokens - window + 1) // self.block_size  # blocks wholly before
            if seq.hold_kv:  # a decode worker takes the window of its own hit, which starts up to a block earlier
                end = min(end, first_sent(self.groups, group, self.block_size, seq.num_prompt_tokens))
            if end <= freed[group]:
                continue
            table = tables[group]
            gone = [table[i] for i in range(freed[group], end) if table[i] != self.null_block]
            self.block_manager.free(gone)  # oldest first: they age first
            table[freed[group] : end] = [self.null_block] * (end - freed[group])
            freed[group] = end

    def free(self, seq: Sequence) -> None:
        """Release every group's blocks of `seq`, children before parents, and any load it had running."""
        for source in self.sources:
            source.forget(seq)
        for table in self.tables(seq):
            self.block_manager.free([b for b in reversed(table) if b != self.null_block])
        self._tables.pop(seq.seq_id, None)
        self._freed.pop(seq.seq_id, None)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.block_table = []
        seq.block_hashes = []
