"""Prefix hits of a model with KV groups (`GroupKVCacheManager`): how each group's blocks are keyed in the prefix
index and the longest prefix every group serves.

A full group 0 keeps the prefix tree of the plain path (its hashes are the chain's). Every other group registers each
block on its own, a root of the index keyed by the group and the chain hash of the block before it
(`GroupPrefix.key`), so a sliding group's early blocks can be evicted while its later ones are in use. A hit needs
every block of a full group and only the last ``ceil((W - 1) / block_size)`` of a sliding group, found scanning from
the right (vLLM's ``SlidingWindowManager.find_longest_cache_hit``); its length is the longest every group serves,
asked again until no group shortens it.

Past the device (`extend`, for the lower KV tiers): the hit may take each group's blocks from the device or from a
tier, block by block, so a group's block evicted alone is loaded alone; a sliding group's blocks before its window are
never looked up nor loaded. The tiers are asked about the blocks the device lacks, once per request and key set
(`kv_runtime.group_tiers`).

A waiting request is matched every step: its chain and its groups' keys are hashed once and kept by sequence id
until it is admitted (at most `MAX_REMEMBERED` sequences), so a step's lookups are dict reads. Probes (a router's
overlap question, from another thread) keep nothing.
"""

from __future__ import annotations

from sage_infer.core.sequence import Sequence
from sage_infer.kv_policy.group_hit import served_by
from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.prefix_reuse.hashing import hash_block, hash_token_blocks
from sage_infer.prefix_reuse.index import PrefixMatch, PrefixReuseIndex

GROUP_MARK = b"\x1fkv-group "  # what `GroupPrefix.key` puts between a tenant's extra key and the group
CHAIN_HASH_BYTES = 32  # a chained block hash (sha256)
MAX_REMEMBERED = 4096  # sequences whose hashes are kept between steps (dropped all at once past it)
LOAD = -1  # a `GroupMatch.plan` entry whose block a lower tier holds (never a block id)


class GroupMatch(PrefixMatch):
    """A `PrefixMatch` with each group's blocks of the prefix (`group_block_ids[g]`, the null block where a sliding
    group needs none); `block_ids` are group 0's.

    With lower tiers (`GroupPrefix.extend`): `plan[g]` is group `g`'s table of the whole hit (`total_tokens`): a device
    block, the null block, or `LOAD` where `lower_block_hashes[k]` goes (at `lower_slots[k]`, (group, position), in
    position order); it also names the device's own hit's window blocks, kept should a load come back short.
    `chain`: the chain hashes of the whole hit."""

    __slots__ = ("group_block_ids", "plan", "lower_slots", "chain")

    def __init__(self, group_block_ids: list[list[int]], block_hashes: list[bytes], num_tokens: int,
                 num_query_blocks: int) -> None:
        super().__init__(group_block_ids[0], block_hashes, num_tokens, num_query_blocks)
        self.group_block_ids = group_block_ids
        self.plan: list[list[int]] | None = None
        self.lower_slots: list[tuple[int, int]] = []
        self.chain: list[bytes] = block_hashes

    def drop_plan(self) -> None:
        """Serve the device's hit only (the lower blocks are not worth loading)."""
        self.plan, self.lower_slots, self.chain = None, [], self.block_hashes
        self.lower_block_hashes, self.num_lower_tokens = [], 0


class GroupPrefix:
    """The prefix hits of `groups` in `index` (blocks of `block_size` tokens); `null_block` fills a sliding group's
    entries before its window."""

    def __init__(self, index: PrefixReuseIndex, groups: KVGroups, block_size: int, null_block: int) -> None:
        self.index = index
        self.groups = groups
        self.block_size = block_size
        self.null_block = null_block
        self.num_groups = len(groups.groups)
        self.tree = groups.groups[0].window is None  # group 0 keeps the prefix tree of the plain path
        self._chains: dict[int, list[bytes]] = {}  # seq id -> its chain hashes so far
        self._keys: dict[tuple[int, int], dict[int, bytes]] = {}  # (seq id, group) -> its blocks' index hashes

    @staticmethod
    def key(extra_key: bytes, group: int, before: bytes | None) -> bytes:
        """The index key of a group's block registered on its own: the group and the chain hash of the block before."""
        return b"%s\x1fkv-group %d\x1f%s" % (extra_key, group, before or b"")

    @staticmethod
    def tenant(key: bytes) -> bytes:
        """The extra key (a tenant's: its salt is in it) a `key` was made from; any other key as it is."""
        for tail in (0, CHAIN_HASH_BYTES):  # the chain hash before: none (a prefix's first block), or one
            body = key[: len(key) - tail]
            cut = body.rfind(GROUP_MARK)
            if body.endswith(b"\x1f") and cut >= 0 and body[cut + len(GROUP_MARK) : -1].isdigit():
                return key[:cut]
        return key

    def forget(self, seq: Sequence) -> None:
        """`seq` was admitted or freed: drop its kept hashes."""
        self._chains.pop(seq.seq_id, None)
        for group in range(self.num_groups):
            self._keys.pop((seq.seq_id, group), None)

    def match(self, seq: Sequence, limit: int) -> GroupMatch:
        """The longest prefix of at most `limit` full blocks of `seq` every group serves now. Records nothing."""
        if self.tree:
            tree = self.index.match(seq.token_ids, seq.extra_key, max_blocks=limit, record=False)
            length, chain = len(tree.block_ids), tree.block_hashes
        else:
            length, chain = limit, self._chain(seq, limit)
        length = self.agreed(length, lambda group, n: self._longest(seq, group, chain, n))
        ids = [tree.block_ids[:length] if group == 0 and self.tree else self._blocks(seq, group, chain, length)
               for group in range(self.num_groups)]
        return GroupMatch(ids, chain[:length], length * self.block_size, limit)

    def agreed(self, length: int, longest) -> int:
        """The longest prefix of at most `length` blocks every group serves, `longest(group, n)` being the longest
        of at most `n` one group serves: full groups serve any shorter prefix, a sliding group may not, so each is
        asked again until all agree."""
        while True:
            shortest = min(longest(group, length) for group in range(self.num_groups))
            if shortest == length:
                return length
            length = shortest

    def served(self, group: int, length: int, has) -> int:
        """The longest prefix of at most `length` blocks `group` serves when `has(i)` says whether its block `i` is
        there: every block from the start in a full group, the last `window_blocks` before the prefix's end in a
        sliding one (found scanning from the right)."""
        return served_by(lambda _, i: has(i), group, self.groups.window_blocks(group, self.block_size), length)

    def first_needed(self, group: int, length: int) -> int:
        """The first block of `group` a prefix of `length` blocks needs (the rest before it: the null block)."""
        need = self.groups.window_blocks(group, self.block_size)
        return 0 if need < 0 else max(0, length - need)

    def extend(self, seq: Sequence, match: GroupMatch, limit: int, below) -> list[int]:
        """Extend the device's `match` to the longest prefix of at most `limit` blocks every group serves from the
        device or the lower tiers: `below(keys)` is ``{key: tier level}`` for the `keys` a tier holds. Sets
        `match.plan` (None when the tiers add nothing), `lower_block_hashes`, `lower_slots`, `num_lower_tokens`
        and `chain`; returns each lower block's tier level. Looks the device up afresh (only the tiers' answers
        may be stale: a load returns what it verifies)."""
        device_length = match.num_tokens // self.block_size
        chain = self._chain(seq, limit)
        found = _Found(self, seq, chain, below, device_length)
        bound = limit  # the full groups' bound first (every block from the start), then only the windows before it
        for group in range(self.num_groups):
            if self.groups.window_blocks(group, self.block_size) < 0:
                found.look(group, range(device_length, limit))
                bound = min(bound, self.served(group, bound, lambda i, group=group: found.has(group, i)))
        for group in range(self.num_groups):
            need = self.groups.window_blocks(group, self.block_size)
            if need > 0:
                found.look(group, range(max(self.first_needed(group, device_length), bound - need), bound))
        length = self.agreed(bound, lambda group, n: self.served(group, n, lambda i: found.has(group, i)))
        held, keys, levels = found.held, found.keys, found.levels
        if length <= device_length:
            return []
        plan = []
        for group, ids in enumerate(match.group_block_ids):
            needed = self.first_needed(group, length)
            # the device's own hit stays named (a sliding group's window of it is what a short load falls back on);
            # past it, a sliding group's blocks before the hit's window are not needed
            table = list(ids) + [held.get((group, i), LOAD) if i >= needed else self.null_block
                                 for i in range(device_length, length)]
            plan.append(table)
        slots = sorted((i, group) for group, table in enumerate(plan) for i in range(len(table)) if table[i] == LOAD)
        match.plan, match.chain = plan, chain[:length]
        match.lower_slots = [(group, i) for i, group in slots]
        match.lower_block_hashes = [keys[group, i] for i, group in slots]
        match.num_lower_tokens = (length - device_length) * self.block_size
        return [levels[key] for key in match.lower_block_hashes]

    def block_key(self, seq: Sequence, group: int, chain: list[bytes], i: int) -> bytes:
        """The index hash of `group`'s block `i` of `seq` (what the tiers keep it under)."""
        if group == 0 and self.tree:
            return chain[i]
        return self._group_key(seq, group, chain, i)

    def device_block(self, seq: Sequence, group: int, chain: list[bytes], i: int) -> int | None:
        """`group`'s block `i` of `seq` if the device holds it (tokens verified)."""
        if group == 0 and self.tree:
            if self.index.block_of(chain[i]) is None:
                return None
            bs = self.block_size
            return self.index.lookup(chain[i - 1] if i else None, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_key)
        return self._lookup(seq, group, chain, i)

    def _chain(self, seq: Sequence, n: int) -> list[bytes]:
        bs = self.block_size
        chain = self._chains.get(seq.seq_id, []) if seq.seq_id >= 0 else []
        if len(chain) < n:
            chain = chain + hash_token_blocks(seq.token_ids[len(chain) * bs : n * bs], bs, seq.extra_key,
                                              parent=chain[-1] if chain else None)
            self._keep(self._chains, seq.seq_id, chain)
        return chain

    def _keep(self, store: dict, key, value) -> None:
        if (key if isinstance(key, int) else key[0]) < 0:
            return  # a probe: nothing kept
        if len(store) >= MAX_REMEMBERED:
            store.clear()
        store[key] = value

    def _group_key(self, seq: Sequence, group: int, chain: list[bytes], i: int) -> bytes:
        """The index hash of `group`'s block `i` of `seq` (kept by sequence id; each is hashed only when asked for:
        a block's key needs only its tokens and the chain before it)."""
        keys = self._keys.get((seq.seq_id, group)) if seq.seq_id >= 0 else None
        if keys is None:
            keys = {}
            self._keep(self._keys, (seq.seq_id, group), keys)
        key = keys.get(i)
        if key is None:
            bs = self.block_size
            key = keys[i] = hash_block(None, seq.token_ids[i * bs : (i + 1) * bs],
                                       self.key(seq.extra_key, group, chain[i - 1] if i else None))
        return key

    def _lookup(self, seq: Sequence, group: int, chain: list[bytes], i: int) -> int | None:
        """Block `i` of `group` for `seq` if the index holds it (tokens verified on a hit)."""
        bs = self.block_size
        if self.index.block_of(self._group_key(seq, group, chain, i)) is None:
            return None
        tokens = seq.token_ids[i * bs : (i + 1) * bs]
        return self.index.lookup(None, tokens, self.key(seq.extra_key, group, chain[i - 1] if i else None))

    def _longest(self, seq: Sequence, group: int, chain: list[bytes], length: int) -> int:
        """The longest prefix of at most `length` blocks `group` serves."""
        if group == 0 and self.tree:
            return length  # the tree's match bounds the first length
        return self.served(group, length, lambda i: self._lookup(seq, group, chain, i) is not None)

    def _blocks(self, seq: Sequence, group: int, chain: list[bytes], length: int) -> list[int]:
        first = self.first_needed(group, length)
        return [self.null_block] * first + [self._lookup(seq, group, chain, i) for i in range(first, length)]


class _Found:
    """What `GroupPrefix.extend` learned of `seq`'s blocks: each looked-up (group, position)'s device block, or its key
    and the tier level holding it (the tiers asked once per batch of keys the device lacks)."""

    def __init__(self, prefix: GroupPrefix, seq: Sequence, chain: list[bytes], below, device_length: int) -> None:
        self.prefix, self.seq, self.chain, self.below = prefix, seq, chain, below
        self.device_length = device_length
        self.held: dict[tuple[int, int], int] = {}  # (group, position) -> device block
        self.keys: dict[tuple[int, int], bytes] = {}  # (group, position) -> key, for the blocks the device lacks
        self.levels: dict[bytes, int] = {}  # key -> tier level, for the keys a tier holds

    def look(self, group: int, positions) -> None:
        """Look `group`'s blocks at `positions` up on the device, and the ones it lacks in the tiers."""
        missing = []
        for i in positions:
            if (group, i) in self.held or (group, i) in self.keys:
                continue
            block = self.prefix.device_block(self.seq, group, self.chain, i)
            if block is not None:
                self.held[group, i] = block
            else:
                self.keys[group, i] = self.prefix.block_key(self.seq, group, self.chain, i)
                missing.append(self.keys[group, i])
        if missing:
            self.levels.update(self.below(missing))

    def has(self, group: int, i: int) -> bool:
        """Whether `group`'s block `i` is on the device or in a tier (looked up now if it was not yet)."""
        if i < self.device_length and self.prefix.groups.window_blocks(group, self.prefix.block_size) < 0:
            return True  # (a full group's blocks of the device's hit)
        if (group, i) not in self.held and (group, i) not in self.keys:
            self.look(group, (i,))
        return (group, i) in self.held or self.levels.get(self.keys.get((group, i)), 0) > 0
