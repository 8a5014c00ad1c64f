"""`KVSource`: where a prompt's KV past the device prefix cache can come from, besides computing it.

`KVCacheManager` is given its sources at construction and treats them alike:

- ``claims(seq)``: whether this source answers for `seq` (the first source that claims it does);
- ``lookup(seq, match, max_blocks, now)``: extend a device `PrefixMatch` with the chain's next blocks this
  source can deliver (``match.lower_block_hashes``); side-effect free as far as admission is concerned;
- ``is_loading(seq)``: its rows are still on their way: the scheduler admits other requests meanwhile;
- ``take(seq, match, now)``: at admission, the rows for ``match.lower_block_hashes`` (a verified prefix of
  them, possibly none), which the manager writes into fresh device blocks and registers;
- ``forget(seq)``: the request ended; drop whatever is pending for it.

Two sources exist:

- `TierSource`: the lower tiers (host DRAM, disk, Redis / Mooncake) of a `HierarchyManager`, with an
  optional background reader (`KVLoader`, a prefetch started when the request is queued);
- `TransferSource`: prefill/decode separation's receiving side, the prompt blocks a prefill instance
  sent (`KVTransfers`); a received request is served from them, never from the tiers.

Both between steps (``poll``) and while the engine has nothing to run (``wait``), the manager asks every
source in turn; ``busy`` says a source still has work in flight that must keep the engine stepping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.hierarchy import HierarchyManager
from sage_infer.kv_runtime.loader import KVLoader
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.transfers import KVTransfers
from sage_infer.prefix_reuse.hashing import hash_token_blocks
from sage_infer.prefix_reuse.index import PrefixMatch

LOWER_LOOKUP_TTL_S = 0.5  # a waiting request's lower-tier lookup is reused this long (see TierSource.lookup)


class KVSource(Protocol):
    """Prompt blocks from somewhere other than the device pool's computation (see the module docstring)."""

    name: str
    pool: KVPool  # the device pool the taken rows are written into
    counts_as_lower_hit: bool  # loaded tokens count in `KVCacheManager.lower_hit_tokens` (tier hits)
    prefetches: bool  # `prefetch` starts a background read (else the manager does not look up at queueing)

    def claims(self, seq: Sequence) -> bool: ...
    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None: ...
    def prefetch(self, seq: Sequence, match: PrefixMatch) -> None: ...
    def is_loading(self, seq: Sequence) -> bool: ...
    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None: ...
    def forget(self, seq: Sequence) -> None: ...
    def poll(self, free: Callable[[Sequence], None]) -> None: ...
    def wait(self, timeout: float) -> bool: ...
    @property
    def busy(self) -> bool: ...
    def close(self) -> None: ...


class TierSource:
    """The lower tiers of a `HierarchyManager`: blocks evicted from the device (or kept from a previous run)."""

    name = "tiers"
    counts_as_lower_hit = True

    def __init__(self, hierarchy: HierarchyManager, load_timeout_s: float | None = None) -> None:
        self.hierarchy = hierarchy
        self.pool = hierarchy.pool
        # with a deadline, reads run off the engine thread (prefetch); without, at admission
        self.loader = KVLoader(hierarchy, load_timeout_s) if load_timeout_s else None
        self.prefetches = self.loader is not None
        self._seen: dict[int, tuple[float, tuple, list[bytes]]] = {}  # seq id -> (when, device prefix, keys)

    def claims(self, seq: Sequence) -> bool:
        return True

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        """Extend `match` with the chain's next blocks that the lower tiers hold (stops at the first gap).

        A waiting request is matched every step; its lower-tier answer is reused for
        `LOWER_LOOKUP_TTL_S` while its device prefix stays the same, so a remote tier sees one
        lookup per request, not one per step. A stale answer is safe: the load returns the
        verified prefix it finds, and the rest is computed.
        """
        bs = self.pool.block_size
        device = (len(match.block_ids), match.block_hashes[-1] if match.block_hashes else None)
        seen = self._seen.get(seq.seq_id)
        if seen is not None and seen[1] == device and now - seen[0] < LOWER_LOOKUP_TTL_S:
            keys = seen[2]
        else:
            rest = seq.token_ids[len(match.block_ids) * bs : match.num_query_blocks * bs]
            keys = hash_token_blocks(rest, bs, seq.extra_key, device[1])
            keys = keys[: self.hierarchy.lookup(keys)]
            self._seen[seq.seq_id] = (now, device, keys)
        match.lower_block_hashes = list(keys)
        match.num_lower_tokens = len(keys) * bs

    def prefetch(self, seq: Sequence, match: PrefixMatch) -> None:
        """A request entered the waiting queue: start reading its lower-tier prefix now (with a loader)."""
        if self.loader is not None and match.lower_block_hashes and seq.seq_id not in self.loader.pending:
            self.loader.start(seq.seq_id, match.lower_block_hashes, len(match.block_ids))

    def is_loading(self, seq: Sequence) -> bool:
        """Its prefetch is still reading (and within its deadline)."""
        return self.loader is not None and self.loader.is_loading(seq.seq_id)

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        """The blocks out of the tiers, before the device allocates (its evictions demote into them)."""
        self._seen.pop(seq.seq_id, None)
        self.hierarchy.tick(now)
        if not match.lower_block_hashes:
            return None
        self.hierarchy.migrator.saw_below(match.lower_block_hashes)
        staged = None
        if self.loader is not None:
            staged = self.loader.take(seq.seq_id, match.lower_block_hashes, len(match.block_ids))
        return staged if staged is not None else self.hierarchy.fetch(match.lower_block_hashes)

    def forget(self, seq: Sequence) -> None:
        if self.loader is not None:
            self.loader.drop(seq.seq_id)
        self._seen.pop(seq.seq_id, None)

    def poll(self, free: Callable[[Sequence], None]) -> None:
        """Take the tiers' background failures (the disk writer's) into their health and counters."""
        self.hierarchy.poll_background()

    def wait(self, timeout: float) -> bool:
        if self.loader is None or not self.loader.pending:
            return False
        self.loader.wait(timeout)
        return True

    @property
    def busy(self) -> bool:
        return False  # a load never keeps the engine stepping on its own: the request waiting for it does

    def close(self) -> None:
        """Stop the background reader and the tiers' work (the disk tier's writer finishes what it queued)."""
        if self.loader is not None:
            self.loader.close()
        self.hierarchy.close()


class TransferSource:
    """Prompt blocks received from a prefill instance (`KVTransfers`), for the request that expects them."""

    name = "transfers"
    counts_as_lower_hit = False
    prefetches = False  # the pipe lands the rows on its own

    def __init__(self, transfers: KVTransfers) -> None:
        self.transfers = transfers
        self.pool = transfers.pool

    def claims(self, seq: Sequence) -> bool:
        return seq.seq_id in self.transfers.received

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        """Extend `match` with the prompt blocks the transfer brought; their hashes are the prompt's chain from its
        first block (computed once, when the transfer was verified)."""
        hashes = self.transfers.received[seq.seq_id].block_hashes
        first = len(match.block_ids)
        last = min(len(hashes), max_blocks) if max_blocks is not None else len(hashes)
        if last > first:
            match.lower_block_hashes = hashes[first:last]
            match.num_lower_tokens = (last - first) * self.pool.block_size

    def prefetch(self, seq: Sequence, match: PrefixMatch) -> None:
        return None

    def is_loading(self, seq: Sequence) -> bool:
        return self.transfers.is_receiving(seq)

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        received = self.transfers.received.pop(seq.seq_id)
        if not match.lower_block_hashes:
            return None  # the device already holds those blocks
        first = len(match.block_ids)
        return received.rows[first : first + len(match.lower_block_hashes)]

    def forget(self, seq: Sequence) -> None:
        self.transfers.cancel(seq)

    def poll(self, free: Callable[[Sequence], None]) -> None:
        """Free what sends finished with (or holds that expired), and keep what arrived for admission."""
        self.transfers.poll(free)

    def wait(self, timeout: float) -> bool:
        """Sleep until the pipe finished something or `timeout` passes; its results are polled next step."""
        if not self.transfers.busy:
            return False
        self.transfers.wake.wait(timeout)
        self.transfers.wake.clear()
        return True

    @property
    def busy(self) -> bool:
        return self.transfers.busy

    def close(self) -> None:
        self.transfers.close()
