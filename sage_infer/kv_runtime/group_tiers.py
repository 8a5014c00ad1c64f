"""`GroupTierSource`: the lower KV tiers of a model with KV groups (`GroupKVCacheManager`, sliding-window layers).

Every group's blocks live in the tiers under their own prefix-index hashes (`GroupPrefix.key`: a group's block is
keyed by its tokens, the group and the chain before it), so demotion is the plain path's: an evicted block of any
group is one block of the one pool, demoted as it is. What differs is the hit: a prompt needs every full group's
block of its prefix but only the last ``ceil((W - 1) / block_size)`` blocks of each sliding group, and any of them
may sit on the device or below it, each on its own. `GroupPrefix.extend` finds the longest prefix every group serves
from the two together and plans which blocks to take from the device and which to load; the load moves only those
(after vLLM's hybrid allocator: a sliding-window group's cache hit is its window, found from the right). A hybrid
prefix therefore moves the full groups' blocks and a window per sliding group, not every layer's whole prefix.

Everything else (the background reader, hot promotion, write-through copies, a shutdown's copy to disk) is
`TierSource`'s.
"""

from __future__ import annotations

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.group_prefix import GroupMatch, GroupPrefix
from sage_infer.kv_runtime.tier_source import LOWER_LOOKUP_TTL_S, TierSource
from sage_infer.prefix_reuse.index import PrefixMatch


class GroupTierSource(TierSource):
    """`TierSource` for a block table per KV group; `prefix` is the `GroupKVCacheManager`'s (set when it takes this
    source)."""

    prefix: GroupPrefix | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._below: dict[int, tuple[float, dict[bytes, int]]] = {}  # seq id -> (when, key -> tier level or 0)

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        """Extend the device's `match` with the blocks each group needs from the tiers (`GroupPrefix.extend`).

        The tiers' answer for a key is kept `LOWER_LOOKUP_TTL_S` per waiting request (a remote tier sees one
        question per key, not one per step); the device is looked up afresh every time. When the measured rates
        say computing the extra tokens is faster than reading their blocks, the device's hit alone is served.
        """
        if self.prefix is None or not isinstance(match, GroupMatch) or max_blocks is None:
            return
        seen = self._below.get(seq.seq_id)
        if seen is None or now - seen[0] >= LOWER_LOOKUP_TTL_S:
            seen = self._below[seq.seq_id] = (now, {})
        known = seen[1]

        def below(keys: list[bytes]) -> dict[bytes, int]:
            unknown = [key for key in keys if key not in known]
            if unknown:
                known.update(zip(unknown, self.hierarchy.levels(unknown)))
            return {key: known[key] for key in keys if known[key]}

        levels = self.prefix.extend(seq, match, max_blocks, below)
        self._declined.pop(seq.seq_id, None)
        # all or none: a hit shortened by a block needs another window of each sliding group
        rates = self.hierarchy.rates
        if levels and rates is not None and not rates.worth_reading(levels, match.num_lower_tokens, match.num_tokens):
            self._declined[seq.seq_id] = len(levels)
            match.drop_plan()

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        """The planned lower blocks out of the tiers (a verified prefix of them, in position order), before the
        device allocates."""
        self._below.pop(seq.seq_id, None)
        return super().take(seq, match, now)

    def on_device_hit(self, keys: list[bytes], block_ids: list[int]) -> None:
        """Admission took these device blocks (every group's): the hot set and the write policy count the hit."""
        self.hierarchy.migrator.used_on_device(keys)
        self.hierarchy.hit(keys, block_ids)

    def forget(self, seq: Sequence) -> None:
        self._below.pop(seq.seq_id, None)
        super().forget(seq)
