"""KV groups: which layers share a block table, and what a block of each group keeps.

Layers are grouped by what their KV is for (full attention; a sliding window of ``W`` keys), after vLLM's hybrid
allocator (`vllm/v1/core/kv_cache_utils.py`, ``_get_kv_cache_groups_uniform_page_size``): the layers of one kind
form groups of an equal layer count (the smallest kind's count, or the largest when no kind has half again as many
layers as another), a kind's ``i``-th group taking its layers ``i::n``. Every group's block then holds the same number
of layers, so one pool of equal blocks (one free list) serves all of them: a pool block holds one group's layers, and
model layer ``l`` stores in the pool's layer `slot_of[l]` of its group's blocks.

A model whose every layer attends fully has one group of all its layers: the pool, the block table and the prefix
cache are what they were before groups existed (`KVGroups.per_group` is False and nothing here is used).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers sharing one block table: `window` None is full attention (every token kept), else a sliding window of
    that many keys (blocks wholly before the window of the next query go back to the pool)."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"sliding {self.window}"

    def blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of `num_tokens` computed tokens holds in this group at most, between steps: every block
        in a full group; those the next query's window reaches (``W - 1`` keys back) in a sliding one."""
        blocks = -(-num_tokens // block_size)
        if self.window is None:
            return blocks
        first = max(0, num_tokens - self.window + 1) // block_size
        return blocks - first


@dataclass(frozen=True, slots=True)
class KVGroups:
    """The groups of a model's layers (full groups first), the layers a pool block holds (`layers_per_block`), and per
    model layer its group and its layer within the group's blocks."""

    groups: tuple[KVGroup, ...]
    layers_per_block: int
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]

    @property
    def per_group(self) -> bool:
        """Whether some layer keeps less than every token (a sliding window): then the KV manager keeps a block
        table per group and frees what falls out of a window. False: one full group, the plain path."""
        return any(group.window is not None for group in self.groups)

    @property
    def layer_map(self) -> tuple[tuple[int, int], ...]:
        """(group, pool layer) of each model layer, what attention reads its group's metadata and blocks by."""
        return tuple(zip(self.group_of, self.slot_of))

    def window_blocks(self, group: int, block_size: int) -> int:
        """Blocks of `group` a prefix hit needs before the first token it computes: every one in a full group
        (returned as -1), ``ceil((W - 1) / block_size)`` in a sliding one (the keys the next query sees)."""
        window = self.groups[group].window
        return -1 if window is None else -(-(window - 1) // block_size)

    def sequence_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks, all groups together, a sequence of `num_tokens` computed tokens holds between steps."""
        return sum(group.blocks_per_sequence(num_tokens, block_size) for group in self.groups)

    def describe(self, bytes_per_block: int, block_size: int) -> list[dict]:
        """Per group: kind, layers, bytes a token takes in it, tokens one GiB of blocks holds, and how many tokens a
        sequence keeps there at most (None: all of them)."""
        rows = []
        for index, group in enumerate(self.groups):
            kept = None if group.window is None else (self.window_blocks(index, block_size) + 1) * block_size
            rows.append({"group": index, "kind": group.kind, "layers": list(group.layers),
                         "bytes_per_token": bytes_per_block // block_size,
                         "tokens_per_gib": GIB // bytes_per_block * block_size, "max_tokens_per_sequence": kept})
        return rows


def kv_groups(layer_windows: Sequence[int | None]) -> KVGroups:
    """The KV groups of a model whose layer ``l`` has the sliding window `layer_windows[l]` (None: full attention)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    order = sorted(kinds, key=lambda window: (window is not None, window or 0))  # full first, then by window
    sizes = [len(kinds[window]) for window in order]
    size = min(sizes)
    if max(sizes) < size * 1.5:  # a little padding rather than many groups
        size = max(sizes)
    groups: list[KVGroup] = []
    for window in order:
        layers = kinds[window]
        count = -(-len(layers) // size)
        groups.extend(KVGroup(window, tuple(layers[i::count])) for i in range(count))
    group_of = [0] * len(layer_windows)
    slot_of = [0] * len(layer_windows)
    for index, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = index, slot
    return KVGroups(tuple(groups), size, tuple(group_of), tuple(slot_of))
