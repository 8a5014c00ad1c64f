"""What a KV-aware router reads of an engine's device prefix cache.

`PrefixView` answers for any engine with prefix caching: how many of a prompt's tokens its device
cache holds now, the cache's stored/removed events, and a prompt's block hashes as those events
name them. The engine assembles it (`LLMEngine.prefix`); the server's router routes reach it through
`NativeBackend`.
"""

from __future__ import annotations

from collections.abc import Callable

from sage_infer.kv_runtime.kv_groups import KVGroups
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import ExtraKeys, prompt_block_hashes
from sage_infer.prefix_reuse.index import PrefixReuseIndex


class PrefixView:
    """What a KV-aware router reads of an engine's device prefix cache (`index` None: prefix caching off)."""

    def __init__(self, index: PrefixReuseIndex | None, block_size: int, extra_key: ExtraKeys,
                 num_blocks: int = 0, overlap: Callable[[list[int], bytes], int] | None = None,
                 groups: KVGroups | None = None) -> None:
        self.index = index
        self.groups = groups  # the KV groups of a model with sliding-window layers (None: one full group)
        self._overlap = overlap  # a KV manager with a table per KV group answers for every group
        self.block_size = block_size
        self.num_blocks = num_blocks  # the device pool's capacity (a router weighs what a miss would evict)
        self.extra_key = extra_key

    def overlap(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Prompt tokens whose KV the device cache holds now. Records nothing; safe to call from another thread
        (dict reads; a concurrent eviction only makes the answer stale)."""
        if self.index is None or not token_ids:
            return 0
        if self._overlap is not None:
            return self._overlap(token_ids, self.extra_key(cache_salt))
        return self.index.match(token_ids, self.extra_key(cache_salt), record=False).num_tokens

    def events(self, since: int):
        """Stored/removed block hashes since event `since` (an `EventBatch`), or None when not logged."""
        events = self.index.events if self.index is not None else None
        return events.since(since) if events is not None else None

    def read_events(self, since: int):
        """Every medium's events since event `since`, or the whole current set (an `EventRead`); None when not
        logged."""
        events = self.index.events if self.index is not None else None
        return events.read(since) if events is not None else None

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        """The short hashes of the prompt blocks a prefix hit could cover (all full blocks before the last token),
        as `events` reports them: a router matches one against the other."""
        return [short(h) for h in prompt_block_hashes(token_ids, self.block_size, self.extra_key(cache_salt))]

    def recipe(self) -> dict | None:
        """How this engine names its blocks, for a router that hashes token-id prompts itself: the block size and
        the parts of the extra key (`prefix_reuse.hashing.ExtraKeys`) besides a request's cache salt; and how many
        blocks its device holds; with KV groups, each group's kind and window (``kv_groups``, in vLLM's words), as its
        events name the groups."""
        if self.index is None:
            return None
        key = self.extra_key
        recipe = {"block_size": self.block_size, "model_id": key.model_id, "revision": key.revision,
                  "kv_dtype": key.kv_dtype, "layout": key.layout, "num_blocks": self.num_blocks}
        if self.groups is not None:
            recipe["kv_groups"] = [{"kind": "full_attention" if group.window is None else "sliding_window",
                                    "sliding_window": group.window} for group in self.groups.groups]
        return recipe
