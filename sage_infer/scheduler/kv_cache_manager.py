"""Sequence-level KV bookkeeping on top of the block manager and the prefix index:
prefix hits on admission, block growth, registration of full blocks, release."""

from __future__ import annotations

import time

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager


class KVCacheManager:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.index = block_manager.index  # None when prefix caching is off
        self.block_size = block_manager.block_size

    def match_prefix(self, seq: Sequence) -> int:
        """Take the longest cached prefix of `seq` (full blocks, token ids verified).

        At least one token is always left to compute, since its logits are needed.
        Returns the number of tokens found.
        """
        if self.index is None or seq.block_table:
            return 0
        self.index.policy.tick(time.monotonic())
        max_blocks = (seq.num_tokens - 1) // self.block_size
        match = self.index.match(seq.token_ids, seq.extra_key, max_blocks=max_blocks)
        if match.block_ids:
            self.block_manager.acquire(match.block_ids)
            seq.block_table = list(match.block_ids)
            seq.block_hashes = list(match.block_hashes)
            seq.num_computed_tokens = match.num_tokens
        return match.num_tokens

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_new_tokens` more; False if the pool is short."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed == 0:
            return True
        if not self.block_manager.can_allocate(needed):
            return False
        seq.block_table.extend(self.block_manager.allocate(needed))
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step computed KV: register newly full blocks so later requests can hit them."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if self.index is not None:
            for i in range(len(seq.block_hashes), full):
                parent = seq.block_hashes[i - 1] if i else None
                # a twin computed in the same step may already own this hash: then we move
                # onto its block, so our chain never hangs off an evictable copy
                block_id, block_hash = self.block_manager.cache_block(
                    seq.block_table[i], parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_key
                )
                seq.block_table[i] = block_id
                seq.block_hashes.append(block_hash)
        for i in range(max(0, full - 1), len(seq.block_table)):
            filled = min(bs, max(0, seq.num_computed_tokens - i * bs))
            self.block_manager.set_num_tokens(seq.block_table[i], filled)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, children before parents (leaves age first)."""
        if seq.block_table:
            self.block_manager.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_hashes = []
