"""`TransferSource`: prefill/decode separation (`KVTransfers`) as a `KVSource`.

On a decode instance it serves a received request's prompt blocks from what the prefill instance sent
(never from the tiers); on a prefill instance it holds a finished prompt's blocks until they are sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.sources import KVSource
from sage_infer.kv_runtime.transfers import KVTransfers
from sage_infer.prefix_reuse.index import PrefixMatch


class TransferSource(KVSource):
    """Prompt blocks received from a prefill instance (`KVTransfers`), for the request that expects them."""

    name = "transfers"
    counts_as_lower_hit = False
    prefetches = False  # the pipe lands the rows on its own

    def __init__(self, transfers: KVTransfers) -> None:
        self.transfers = transfers
        self.pool = transfers.pool

    def attach(self, block_manager: BlockManager) -> None:
        if block_manager.index is None:
            raise ValueError("prefill/decode transfers need prefix caching: received KV is registered under "
                             "its block hashes")
        self.block_manager = block_manager

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

    def hold(self, seq: Sequence) -> bool:
        """Keep a finished prompt's blocks for the decode instance that will take them (see `KVTransfers`). A
        prompt shorter than one block has nothing to send: False, and the manager frees it at once."""
        if not self.transfers.num_blocks(seq):
            return False
        self.transfers.hold(seq)
        return True

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
