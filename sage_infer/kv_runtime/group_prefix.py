"""Prefix hits of a model with KV groups (`GroupKVCacheManager`): how each group's blocks are keyed in the prefix
index and the longest prefix every group serves.

A full group 0 keeps the prefix tree of the plain path (its hashes are the chain's). Every other group registers each
block on its own, a root of the index keyed by the group and the chain hash of the block before it
(`GroupPrefix.key`), so a sliding group's early blocks can be evicted while its later ones are in use. A hit needs
every block of a full group and only the last ``ceil((W - 1) / block_size)`` of a sliding group, found scanning from
the right (vLLM's ``SlidingWindowManager.find_longest_cache_hit``); its length is the longest every group serves,
asked again until no group shortens it.

A waiting request is matched every step: its chain and its groups' keys are hashed once and kept by sequence id
until it is admitted (at most `MAX_REMEMBERED` sequences), so a step's lookups are dict reads. Probes (a router's
overlap question, from another thread) keep nothing.
"""

from __future__ import annotations

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.prefix_reuse.hashing import hash_block, hash_token_blocks
from sage_infer.prefix_reuse.index import PrefixMatch, PrefixReuseIndex

MAX_REMEMBERED = 4096  # sequences whose hashes are kept between steps (dropped all at once past it)


class GroupMatch(PrefixMatch):
    """A `PrefixMatch` with each group's blocks of the prefix (`group_block_ids[g]`, the null block where a sliding
    group needs none); `block_ids` are group 0's."""

    __slots__ = ("group_block_ids",)

    def __init__(self, group_block_ids: list[list[int]], block_hashes: list[bytes], num_tokens: int,
                 num_query_blocks: int) -> None:
        super().__init__(group_block_ids[0], block_hashes, num_tokens, num_query_blocks)
        self.group_block_ids = group_block_ids


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
        self._keys: dict[tuple[int, int], list[bytes]] = {}  # (seq id, group) -> its blocks' index hashes so far

    @staticmethod
    def key(extra_key: bytes, group: int, before: bytes | None) -> bytes:
        """The index key of a group's block registered on its own: the group and the chain hash of the block before."""
        return b"%s\x1fkv-group %d\x1f%s" % (extra_key, group, before or b"")

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
        while True:  # full groups serve any shorter prefix; a sliding group may not: ask again until all agree
            shortest = min(self._longest(seq, group, chain, length) for group in range(self.num_groups))
            if shortest == length:
                break
            length = shortest
        ids = [tree.block_ids[:length] if group == 0 and self.tree else self._blocks(seq, group, chain, length)
               for group in range(self.num_groups)]
        return GroupMatch(ids, chain[:length], length * self.block_size, limit)

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

    def _lookup(self, seq: Sequence, group: int, chain: list[bytes], i: int) -> int | None:
        """Block `i` of `group` for `seq` if the index holds it (tokens verified on a hit)."""
        bs = self.block_size
        keys = self._keys.get((seq.seq_id, group), []) if seq.seq_id >= 0 else []
        if len(keys) <= i:
            start = len(keys)
            keys = keys + [hash_block(None, seq.token_ids[j * bs : (j + 1) * bs],
                                      self.key(seq.extra_key, group, chain[j - 1] if j else None))
                           for j in range(start, max(i + 1, len(chain)))]
            self._keep(self._keys, (seq.seq_id, group), keys)
        if self.index.block_of(keys[i]) is None:
            return None
        tokens = seq.token_ids[i * bs : (i + 1) * bs]
        return self.index.lookup(None, tokens, self.key(seq.extra_key, group, chain[i - 1] if i else None))

    def _longest(self, seq: Sequence, group: int, chain: list[bytes], length: int) -> int:
        """The longest prefix of at most `length` blocks `group` serves."""
        if group == 0 and self.tree:
            return length  # the tree's match bounds the first length
        need = self.groups.window_blocks(group, self.block_size)
        if need < 0:  # full: every block from the start
            return next((i for i in range(length) if self._lookup(seq, group, chain, i) is None), length)
        if need == 0:
            return length
        run = 0
        for i in range(length - 1, -1, -1):  # from the right: the last `need` blocks before a prefix end
            if self._lookup(seq, group, chain, i) is None:
                run = 0
                continue
            run += 1
            if run == need:
                return i + need
        return run  # the window reaches the start: the `run` leading blocks are all it needs

    def _blocks(self, seq: Sequence, group: int, chain: list[bytes], length: int) -> list[int]:
        need = self.groups.window_blocks(group, self.block_size)
        first = 0 if need < 0 else max(0, length - need)
        return [self.null_block] * first + [self._lookup(seq, group, chain, i) for i in range(first, length)]
