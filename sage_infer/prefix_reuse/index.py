"""`PrefixReuseIndex`: which full KV blocks in the pool can be reused, and which can go.

The index is a tree keyed by chained block hash: a block's parent is the block holding
the tokens just before it. A lookup walks the chain from the start of a prompt; an
eviction only ever removes a leaf, so the tree never holds an orphan. Each node keeps
its token ids and extra key and a hit compares them, so a hash collision can cost a
miss but never return the wrong KV.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy import EvictionPolicy, make_policy
from sage_infer.kv_policy.quota import DEVICE, QuotaManager
from sage_infer.prefix_reuse.events import BlockEvents
from sage_infer.prefix_reuse.hashing import extend_chain, hash_block
from sage_infer.prefix_reuse.metrics import PrefixReuseMetrics


@dataclass(slots=True)
class PrefixMatch:
    """The cached prefix of a prompt: `block_ids[i]` holds tokens `[i*block_size, (i+1)*block_size)`."""

    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    num_query_blocks: int = 0  # full blocks the lookup asked for (what metrics count as queried)
    # the chain's next blocks after `block_hashes` that a lower KV tier holds (filled by the KV cache manager)
    lower_block_hashes: list[bytes] = field(default_factory=list)
    num_lower_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Tokens found anywhere: on the device, then in the tiers below it."""
        return self.num_tokens + self.num_lower_tokens


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A cached block leaving the index: enough to demote it to a lower tier before its slot is reused."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_key: bytes
    depth: int


@dataclass(slots=True, eq=False)
class _Node:
    block_id: int
    block_hash: bytes
    parent: _Node | None
    token_ids: tuple[int, ...]
    extra_key: bytes
    num_children: int = 0
    depth: int = 0  # position in the prefix chain: 0 for a prompt's first block
    in_use: bool = False  # some request holds the block (only tracked once a block manager binds)
    num_active_children: int = 0  # children whose subtree holds an in-use block

    @property
    def active(self) -> bool:
        """The subtree holds an in-use block, so this block cannot be evicted yet."""
        return self.in_use or self.num_active_children > 0


class PrefixReuseIndex:
    """Maps chained block hashes -> block ids of full blocks whose KV is in the pool.

    A tree: each registered block knows its parent; child counts make only leaves
    evictable. Token ids of each block are stored and compared on every hit.

    When a `BlockManager` binds it (`bind_in_use`), the tree also tracks which blocks
    are in use, so `num_evictable` counts exactly the blocks that eviction can free: a
    cached block above an in-use block (possible when two requests computed the same
    prefix at once) is not counted.
    """

    def __init__(self, block_size: int, policy: EvictionPolicy | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.policy = policy if policy is not None else make_policy("lru")
        self.metrics = PrefixReuseMetrics()
        self._by_hash: dict[bytes, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self._is_in_use: Callable[[int], bool] | None = None
        self._num_active = 0
        # per-tenant shares of the device ("device" tier), when configured: orders eviction; the
        # block manager counts what each tenant holds (in use and cached)
        self.quota: QuotaManager | None = None
        self.events: BlockEvents | None = None  # stored/removed hashes for a KV-aware router (`enable_events`)

    def match(
        self, token_ids: Sequence[int], extra_key: bytes, *, max_blocks: int | None = None, record: bool = True,
        chain: list[bytes] | None = None,
    ) -> PrefixMatch:
        """Longest chain of full blocks from the start of `token_ids` that is cached with identical tokens.

        Counts one query in `metrics` and marks the matched blocks as hit, deepest
        first, so a parent is always more recent than its children. `record=False`
        is a dry run: no metrics, no recency change (`record_hit` records it later).
        `chain`: the caller's kept list of these blocks' chained hashes (`hashing.extend_chain`), grown as far
        as the match reads, so a prompt matched again is not hashed again.
        """
        num_blocks = len(token_ids) // self.block_size
        if max_blocks is not None:
            num_blocks = max(0, min(num_blocks, max_blocks))
        nodes: list[_Node] = []
        parent: _Node | None = None
        # with a kept chain every block is hashed up front (its registration needs the hash anyway)
        hashes = extend_chain(chain, token_ids, self.block_size, extra_key, num_blocks) if chain is not None else None
        for i in range(num_blocks):
            block = token_ids[i * self.block_size : (i + 1) * self.block_size]
            if hashes is None:
                block_hash = hash_block(parent.block_hash if parent else None, block, extra_key)
            else:
                block_hash = hashes[i]
            node = self._by_hash.get(block_hash)
            if node is None or node.parent is not parent or node.extra_key != extra_key:
                break
            if node.token_ids != tuple(block):
                break  # a hash collision: recompute rather than return another prompt's KV
            nodes.append(node)
            parent = node
        match = PrefixMatch(
            block_ids=[n.block_id for n in nodes],
            block_hashes=[n.block_hash for n in nodes],
            num_tokens=len(nodes) * self.block_size,
            num_query_blocks=num_blocks,
        )
        if record:
            self.record_hit(match)
        return match

    def record_hit(self, match: PrefixMatch, *, count_query: bool = True) -> None:
        """What a recorded `match` does: count the query (unless `count_query` is False) and
        mark its blocks as hit, deepest first, so a parent is always more recent than its children."""
        if count_query:
            self.metrics.record(match.num_query_blocks, len(match.block_ids), self.block_size)
        for block_hash in reversed(match.block_hashes):
            self.policy.on_hit(block_hash)

    def num_evictable_among(self, block_ids: Sequence[int]) -> int:
        """How many of these registered blocks eviction could reach now (none in use, none above an in-use one)."""
        return sum(1 for block_id in block_ids if not self._by_block[block_id].active)

    def lookup(self, parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes) -> int | None:
        """The registered block holding exactly these tokens after `parent_hash` (verified), or None."""
        node = self._by_hash.get(hash_block(parent_hash, token_ids, extra_key))
        if node is None or node.token_ids != tuple(token_ids) or node.extra_key != extra_key:
            return None
        if (node.parent.block_hash if node.parent else None) != parent_hash:
            return None
        return node.block_id

    def hash_of(self, block_id: int) -> bytes | None:
        node = self._by_block.get(block_id)
        return node.block_hash if node else None

    def block_of(self, block_hash: bytes) -> int | None:
        node = self._by_hash.get(block_hash)
        return node.block_id if node else None

    def registered(self) -> list[tuple[bytes, int]]:
        """(block hash, block id) of every registered block, parents before children."""
        nodes = sorted(self._by_hash.values(), key=lambda node: node.depth)
        return [(node.block_hash, node.block_id) for node in nodes]

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._by_block

    def is_leaf(self, block_id: int) -> bool:
        """True when no registered block hangs below `block_id` (KeyError if it is not registered)."""
        node = self._by_block.get(block_id)
        if node is None:
            raise KeyError(f"block {block_id} is not registered")
        return node.num_children == 0

    def enable_events(self) -> BlockEvents:
        """Start logging stored/removed hashes (a prefill worker does, for the router)."""
        if self.events is None:
            self.events = BlockEvents(lambda: self._by_hash.keys())
        return self.events

    def __len__(self) -> int:
        return len(self._by_block)

    @property
    def num_evictable(self) -> int:
        """Registered blocks with no in-use block below them: eviction can free all of them, leaf by leaf."""
        return len(self._by_block) - self._num_active

    def insert(
        self, block_id: int, parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes,
        block_hash: bytes | None = None,
    ) -> tuple[bytes, bool]:
        """Register the full block `block_id`; returns `(hash, registered)`.

        When the hash is already registered (another block holds the same KV, or this
        block was registered before) nothing changes and `registered` is False: the
        caller keeps using its block, which is freed normally. An unregistered
        `parent_hash` raises ValueError, so the tree never holds an orphan. `block_hash`: the block's hash when
        the caller has it (`hash_block(parent_hash, token_ids, extra_key)`, from its kept chain).
        """
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are registered: {len(token_ids)} tokens, block_size {self.block_size}")
        parent = None
        if parent_hash is not None:
            parent = self._by_hash.get(parent_hash)
            if parent is None:
                raise ValueError(f"parent block {parent_hash.hex()[:16]}... is not registered (no orphans)")
        if block_hash is None:
            block_hash = hash_block(parent_hash, token_ids, extra_key)
        if block_hash in self._by_hash:
            return block_hash, False
        if block_id in self._by_block:
            raise ValueError(f"block {block_id} is already registered under another hash")
        node = _Node(block_id, block_hash, parent, tuple(token_ids), extra_key,
                     depth=parent.depth + 1 if parent is not None else 0)
        self._by_hash[block_hash] = node
        self._by_block[block_id] = node
        if parent is not None:
            parent.num_children += 1
        self.policy.on_insert(block_hash, node.depth, parent_hash)
        if self.events is not None:
            self.events.stored(block_hash, parent=parent_hash, token_ids=node.token_ids)
        if self._is_in_use is not None and self._is_in_use(block_id):
            self._set_active(node, in_use=True)
            self.policy.on_use(block_hash)
        return block_hash, True

    def evict(self, is_unreferenced: Callable[[int], bool]) -> int | None:
        """Unregister the policy's victim among unreferenced leaves; its block id, or None if none."""
        evicted = self.evict_block(is_unreferenced)
        return evicted.block_id if evicted is not None else None

    def evict_block(self, is_unreferenced: Callable[[int], bool], tenant: bytes | None = None) -> EvictedBlock | None:
        """Unregister the policy's victim among unreferenced leaves and describe it; None if none.

        With a `quota`, the victim also follows the tenants' shares (`tenant`: whose request
        needs the room; None when unknown).
        """

        def evictable(block_hash: bytes) -> bool:
            node = self._by_hash[block_hash]
            return node.num_children == 0 and not node.in_use and is_unreferenced(node.block_id)

        if self.quota is None:
            victim = self.policy.victim(evictable)
        else:
            victim = self.quota.pick_victim(
                DEVICE, tenant,
                lambda extra: self.policy.victim(evictable if extra is None else lambda h: evictable(h) and extra(h)),
                lambda h: self._by_hash[h].extra_key)
        return None if victim is None else self.evict_leaf(self._by_hash[victim].block_id)

    def evict_leaf(self, block_id: int) -> EvictedBlock:
        """Unregister this registered leaf that no request holds and describe it (what `evict_block` does with the
        policy's victim)."""
        node = self._by_block[block_id]
        self._unlink(node)
        return EvictedBlock(node.block_id, node.block_hash, node.parent.block_hash if node.parent else None,
                            node.token_ids, node.extra_key, node.depth)

    def remove(self, block_id: int) -> None:
        """Unregister one leaf block (ValueError if it is unknown or has children)."""
        node = self._by_block.get(block_id)
        if node is None:
            raise ValueError(f"block {block_id} is not registered")
        if node.num_children:
            raise ValueError(f"block {block_id} has {node.num_children} children; only leaves can be removed")
        if node.in_use:
            self._set_active(node, in_use=False)
        self._unlink(node)

    def _unlink(self, node: _Node) -> None:
        assert node.num_children == 0 and not node.active, f"unlinking block {node.block_id} that is not a free leaf"
        del self._by_hash[node.block_hash]
        del self._by_block[node.block_id]
        if self.events is not None:
            self.events.removed(node.block_hash)
        if node.parent is not None:
            node.parent.num_children -= 1
        self.policy.on_remove(node.block_hash)

    def bind_in_use(self, is_in_use: Callable[[int], bool]) -> None:
        """Let one block manager report which blocks are in use (call before any insert)."""
        if self._is_in_use is not None:
            raise ValueError("this prefix index is already bound to a block manager")
        if self._by_block:
            raise ValueError("bind a prefix index to its block manager before registering blocks")
        self._is_in_use = is_in_use

    def set_in_use(self, block_id: int, in_use: bool) -> None:
        """A registered block's ref count left or reached 0; releasing it tells the policy. No-op if unregistered."""
        node = self._by_block.get(block_id)
        if node is None or node.in_use == in_use:
            return
        self._set_active(node, in_use)
        if in_use:
            self.policy.on_use(node.block_hash)
        else:
            self.policy.on_release(node.block_hash)

    def _set_active(self, node: _Node, in_use: bool) -> None:
        # Walk up only while a node's active state flips: acquiring a chain root-first
        # or releasing it leaf-first touches one parent per block.
        was_active = node.active
        node.in_use = in_use
        delta = 1 if in_use else -1
        while node.active != was_active:
            self._num_active += delta
            parent = node.parent
            if parent is None:
                return
            was_active = parent.active
            parent.num_active_children += delta
            node = parent

    def check_invariants(self) -> None:
        """Assert the tree is consistent: parents registered, counts right, maps inverse, no cycles."""
        assert len(self._by_hash) == len(self._by_block), "hash and block maps differ in size"
        active: set[int] = set()  # blocks with an in-use block in their subtree
        for block_id, node in self._by_block.items():
            assert node.block_id == block_id, f"block map disagrees on {block_id}"
            assert self._by_hash.get(node.block_hash) is node, f"hash map disagrees on {block_id}"
            assert len(node.token_ids) == self.block_size, f"block {block_id} is not full"
            if self._is_in_use is not None:
                assert node.in_use == self._is_in_use(block_id), f"block {block_id} in-use flag is stale"
            depth, cursor = 0, node
            while cursor.parent is not None:
                assert self._by_hash.get(cursor.parent.block_hash) is cursor.parent, f"block {block_id} has an orphan"
                cursor = cursor.parent
                depth += 1
                assert depth <= len(self._by_block), f"cycle above block {block_id}"
            if node.in_use:
                cursor = node
                while cursor is not None and cursor.block_id not in active:
                    active.add(cursor.block_id)
                    cursor = cursor.parent
        children = Counter(node.parent.block_id for node in self._by_block.values() if node.parent)
        active_children = Counter(p.block_id for b in active if (p := self._by_block[b].parent) is not None)
        for block_id, node in self._by_block.items():
            assert node.num_children == children.get(block_id, 0), f"block {block_id} child count is wrong"
            assert node.num_active_children == active_children.get(block_id, 0), f"block {block_id} active count"
        assert self._num_active == len(active), "active block count is wrong"
        if hasattr(self.policy, "__len__"):
            assert len(self.policy) == len(self._by_block), "policy tracks other blocks than the index"
