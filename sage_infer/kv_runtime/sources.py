"""`KVSource`: where a prompt's KV past the device prefix cache can come from, besides computing it.

`KVCacheManager` is given its sources at construction (`engine.build` makes them) and treats them alike;
it knows nothing else about any of them. Every hook below is a no-op here, so a source implements only
what it does:

- ``attach(block_manager)``: at construction; check what the source needs and wire its hooks;
- ``claims(seq)``: whether this source answers for `seq` (the first source that claims it does);
- ``lookup(seq, match, max_blocks, now)``: extend a device `PrefixMatch` with the chain's next blocks this
  source can deliver (``match.lower_block_hashes``); side-effect free as far as admission is concerned;
- ``prefetch(seq, match)``: the request entered the waiting queue: start reading its blocks (``prefetches``);
- ``is_loading(seq)``: its rows are still on their way: the scheduler admits other requests meanwhile;
- ``take(seq, match, now)``: at admission, the rows for ``match.lower_block_hashes`` (a verified prefix of
  them, possibly none), which the manager writes into fresh device blocks and registers;
- ``release(rows)``: the manager wrote `take`'s rows into the pool: their buffer may serve the next read;
- ``on_hit(match)``: admission took `match`'s device blocks (every source hears it);
- ``on_computed(block_hashes, block_ids)``: those blocks were registered as newly full on the device;
- ``forget(seq)``: the request ended; drop whatever is pending for it;
- ``hold(seq)``: a finished sequence another instance will take: keep its blocks (True) or not (False);
- ``promote(limit)``: bring blocks ahead of need into free device blocks; how many;
- ``persist()``: a graceful shutdown: keep what the cache holds for a restart; (written, left out);
- ``poll(free)`` between steps, ``wait(timeout)`` while the engine has nothing to run, ``busy``: work in
  flight that must keep the engine stepping; ``stats()``: its `EngineStats` fields; ``close()``.

Two sources exist: `TierSource` (`kv_runtime.tier_source`: the lower tiers of a `HierarchyManager`) and
`TransferSource` (`kv_runtime.transfer_source`: the prompt blocks a prefill instance sent).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.prefix_reuse.index import PrefixMatch


class KVSource:
    """Prompt blocks from somewhere other than the device pool's computation (see the module docstring)."""

    name: str = "source"
    pool: KVPool  # the device pool the taken rows are written into
    counts_as_lower_hit = False  # loaded tokens count in `KVCacheManager.lower_hit_tokens` (tier hits)
    prefetches = False  # `prefetch` starts a background read (else the manager does not look up at queueing)
    stages_lower_hits_only = False  # `take` stages rows only for a match's lower-tier blocks (the tiers)
    block_manager: BlockManager  # set by `attach`

    def attach(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager

    def claims(self, seq: Sequence) -> bool:
        return False

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        return None

    def prefetch(self, seq: Sequence, match: PrefixMatch) -> None:
        return None

    def is_loading(self, seq: Sequence) -> bool:
        return False

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        return None

    def release(self, rows: torch.Tensor | None) -> None:
        return None

    def observe_load(self, seconds: float, blocks: int) -> None:
        """A load of `blocks` of this source's blocks took `seconds` of the engine's time at admission (taking and
        writing its rows)."""
        return None

    def on_hit(self, match: PrefixMatch) -> None:
        return None

    def on_computed(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        return None

    def forget(self, seq: Sequence) -> None:
        return None

    def hold(self, seq: Sequence) -> bool:
        return False

    def promote(self, limit: int) -> int:
        return 0

    def persist(self) -> tuple[int, int]:
        return 0, 0

    def poll(self, free: Callable[[Sequence], None]) -> None:
        return None

    def wait(self, timeout: float) -> bool:
        return False

    @property
    def busy(self) -> bool:
        return False

    def stats(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        return None
