"""Prefill/decode transfers of a model with KV groups (`GroupKVCacheManager`, sliding-window layers).

A transfer carries the blocks the decode worker's prefix hit takes, no more (`transfer_slots`). The decode worker
computes the prompt's last token itself (its logits give the first token), so its hit is at most
``L = (prompt - 1) // block_size`` full blocks: all ``L`` of a full group, and of a sliding group only the last
``ceil((W - 1) / block_size)`` before ``L`` (the keys its first computed query sees). Rows travel in position order,
group by group within a position, each under the key the prefix index registers that group's block by (a full
group 0: the prompt's chained hash; any other: `GroupPrefix.key`), and the receiver checks every row against the key
it computes for its own prompt (tokens, group, the chain before the block, the model / KV dtype / tenant key),
keeping only the rows that agree.

The prefill worker keeps what it will send: a held sequence's sliding groups free no block a transfer carries
(`first_sent`, which `GroupKVCacheManager` bounds its window freeing by). The decode worker serves the received rows as
a lower tier holding exactly those keys: `GroupPrefix.extend` plans the hit (blocks its own cache holds, received
rows for the rest, the null block before a sliding group's window) and `GroupKVCacheManager` writes and registers
them as it does a tier load. Both workers must group their layers alike: the schema digest they compare covers the
groups (`groups_digest`), so a mismatch is refused before a transfer starts, and a row count that still differs
fails the transfer (the request computes its prompt).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.group_prefix import GroupMatch, GroupPrefix
from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.kv_runtime.kv_pipe import TransferResult
from sage_infer.kv_runtime.transfer_source import TransferSource
from sage_infer.kv_runtime.transfers import KVTransfers, ReceivedKV
from sage_infer.prefix_reuse.hashing import hash_block, hash_token_blocks
from sage_infer.prefix_reuse.index import PrefixMatch

log = logging.getLogger("sage_infer.kv_runtime")


def hit_length(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt the decode worker's hit can take: it computes the last token itself."""
    return max(0, num_prompt_tokens - 1) // block_size


def first_sent(groups: KVGroups, group: int, block_size: int, num_prompt_tokens: int) -> int:
    """The first block of `group` a transfer of a `num_prompt_tokens` prompt carries (0 in a full group)."""
    need = groups.window_blocks(group, block_size)
    return 0 if need < 0 else max(0, hit_length(num_prompt_tokens, block_size) - need)


def transfer_slots(groups: KVGroups, block_size: int, num_prompt_tokens: int) -> list[tuple[int, int]]:
    """(group, position) of every block a transfer carries, in the order the rows travel."""
    firsts = [first_sent(groups, g, block_size, num_prompt_tokens) for g in range(len(groups.groups))]
    return [(g, i) for i in range(hit_length(num_prompt_tokens, block_size)) for g, first in enumerate(firsts)
            if i >= first]


def slot_keys(groups: KVGroups, block_size: int, token_ids: list[int], slots: list[tuple[int, int]],
              extra_key: bytes, chain: list[bytes]) -> list[bytes]:
    """The prefix-index key of each slot's block (`chain`: the prompt's chained hashes under `extra_key`)."""
    tree = groups.groups[0].window is None  # a full group 0 keeps the chain of the plain path
    keys = []
    for group, i in slots:
        if group == 0 and tree:
            keys.append(chain[i])
        else:
            before = chain[i - 1] if i else None
            keys.append(hash_block(None, token_ids[i * block_size : (i + 1) * block_size],
                                   GroupPrefix.key(extra_key, group, before)))
    return keys


def groups_digest(digest: str, groups: KVGroups | None) -> str:
    """`digest` (a KV schema's, hex) covering the KV groups too: each group's window and layers."""
    if groups is None or not groups.per_group:
        return digest
    layout = json.dumps([[group.window, list(group.layers)] for group in groups.groups], separators=(",", ":"))
    return hashlib.sha256(f"{digest}/{layout}".encode()).hexdigest()[: len(digest)]


class GroupKVTransfers(KVTransfers):
    """`KVTransfers` whose blocks are every group's a decode worker's hit needs (`transfer_slots`). `tables` gives a
    held sequence's block table per group, `null_block` the entry out of a window (the `GroupKVCacheManager` sets
    both when it takes the source)."""

    def __init__(self, *args, groups: KVGroups, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.tables: Callable[[Sequence], list[list[int]]] | None = None
        self.null_block = -1  # what a table holds out of a window (the manager's)

    def num_blocks(self, seq: Sequence) -> int:
        return len(transfer_slots(self.groups, self.block_size, seq.num_prompt_tokens))

    def blocks(self, seq: Sequence, extra_key: bytes | None) -> tuple[list[int], list[bytes]]:
        slots = transfer_slots(self.groups, self.block_size, seq.num_prompt_tokens)
        tables = self.tables(seq)
        ids = [tables[group][i] for group, i in slots]
        if self.null_block in ids:  # (freed out of a window: never, for a held sequence)
            raise ValueError(f"request {seq.request_id!r} no longer holds every block its transfer carries")
        length = hit_length(seq.num_prompt_tokens, self.block_size)
        chain = seq.block_hashes[:length] if extra_key is None else \
            hash_token_blocks(seq.token_ids[: length * self.block_size], self.block_size, extra_key)
        return ids, slot_keys(self.groups, self.block_size, seq.token_ids, slots, extra_key or seq.extra_key, chain)

    def _verified(self, seq: Sequence, result: TransferResult) -> ReceivedKV | None:
        """The rows whose sender key equals the key this engine computes for that slot of the prompt, with those
        keys; None when none does. A disagreement is counted; what it leaves out is computed."""
        bs = self.block_size
        slots = transfer_slots(self.groups, bs, seq.num_prompt_tokens)
        chain = hash_token_blocks(seq.token_ids[: hit_length(seq.num_prompt_tokens, bs) * bs], bs, seq.extra_key)
        own = slot_keys(self.groups, bs, seq.token_ids, slots, seq.extra_key, chain)
        sent = result.block_hashes
        agree = [row for row, (a, b) in enumerate(zip(own, sent)) if a == b] if len(sent) == len(own) else []
        if len(agree) == len(own):
            return ReceivedKV(result.rows, own)
        self.stats.hash_mismatches += 1
        log.warning("KV transfer %s: %d of the sender's %d block keys differ from this prompt's; the request computes "
                    "what they leave out", result.transfer_id, len(sent) - len(agree), len(sent))
        if not agree:
            self.stats.receive_failures += 1
            return None
        return ReceivedKV(result.rows[agree], [own[row] for row in agree])


class GroupTransferSource(TransferSource):
    """`TransferSource` for a block table per KV group: a received request's hit takes each group's blocks from the
    device cache or the received rows (`GroupPrefix.extend`); `prefix` is the `GroupKVCacheManager`'s."""

    prefix: GroupPrefix | None = None

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        """Extend the device's `match` with the received rows each group's hit needs."""
        if self.prefix is None or not isinstance(match, GroupMatch) or max_blocks is None:
            return
        received = set(self.transfers.received[seq.seq_id].block_hashes)
        self.prefix.extend(seq, match, max_blocks, lambda keys: {key: 1 for key in keys if key in received})

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        """The received rows of the planned slots (`match.lower_block_hashes`), in their order."""
        received = self.transfers.received.pop(seq.seq_id)
        if not match.lower_block_hashes:
            return None  # the device already holds what the hit takes
        row_of = {key: row for row, key in enumerate(received.block_hashes)}
        return received.rows[[row_of[key] for key in match.lower_block_hashes]]

    def on_device_hit(self, keys: list[bytes], block_ids: list[int]) -> None:
        return None
