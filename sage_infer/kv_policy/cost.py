"""Cost-aware eviction: keep the blocks whose loss would cost the most recompute per byte.

Priority is PGDSF, the prefix-aware Greedy-Dual-Size-Frequency of RAGCache (Jin et al.,
2024), after GDSF (Cherkasova, 1998):

    H(block) = L + frequency x cost / size

`frequency` counts the block's own uses (1 on insert, +1 per hit), `cost` is the FLOPs
to recompute the block at its position in the prefix, `size` its KV bytes, and `L` the
inflation value: the priority of the last evicted block. Because H is fixed when a block
is used and L only rises, a block that is not used again ages relative to newly used
ones: frequency x cost / size stands for the reuse probability times the saving, and L
for recency. The evictable block with the lowest H goes first (a heap with lazy deletion).

Recompute cost of block d (0-based) of B tokens, per layer: linear FLOPs
24 x hidden^2 x B (QKV/O projections and a 4x MLP, 2 FLOPs per MAC) plus attention FLOPs
4 x hidden x B x (d + 0.5) x B (QK^T and AV against the d x B tokens before the block and,
on average, half the block itself): later blocks cost more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from sage_infer.kv_policy.base import EvictionPolicy, register_policy
from sage_infer.kv_policy.lfu import LeafHeap


@dataclass(frozen=True, slots=True)
class CostModel:
    """The model shape that prices a block; defaults are Llama-3-8B-like with 512-token blocks
    (the Mooncake trace's block size)."""

    num_layers: int = 32
    hidden: int = 4096
    block_tokens: int = 512
    kv_hidden: int = 1024  # num_kv_heads x head_dim (8 KV heads x 128 under GQA)
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "block_tokens", "kv_hidden", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostModel.{name} must be >= 1, got {getattr(self, name)}")

    def recompute_flops(self, depth: int) -> float:
        """FLOPs to prefill block `depth` (0-based) given the blocks before it."""
        b, h = self.block_tokens, self.hidden
        linear = 24.0 * h * h * b
        attention = 4.0 * h * b * (depth + 0.5) * b
        return self.num_layers * (linear + attention)

    def block_bytes(self) -> int:
        """KV bytes of one block: K and V for every layer."""
        return 2 * self.num_layers * self.kv_hidden * self.block_tokens * self.dtype_bytes

    def value_per_byte(self, depth: int) -> float:
        return self.recompute_flops(depth) / self.block_bytes()


@register_policy("cost")
class CostPolicy(EvictionPolicy):
    """PGDSF: evicts the evictable leaf with the lowest L + frequency x recompute cost / bytes."""

    __slots__ = ("model", "inflation", "_heap", "_freq", "_depth", "_clock")

    def __init__(self, model: CostModel | None = None) -> None:
        self.model = model if model is not None else CostModel()
        self.inflation = 0.0  # L: priority of the last evicted block
        self._heap = LeafHeap()
        self._freq: dict[bytes, int] = {}
        self._depth: dict[bytes, int] = {}
        self._clock = count()  # ties: least recently used first

    def priority(self, key: bytes) -> float:
        """The block's current H."""
        return self._heap.prio[key][0]

    def on_insert(self, key: bytes, depth: int = 0, parent: bytes | None = None) -> None:
        if key in self._freq:
            self.on_hit(key)
            return
        self._freq[key] = 1
        self._depth[key] = depth
        self._heap.add(key, self._priority(key), parent)

    def on_hit(self, key: bytes) -> None:
        self._freq[key] += 1
        self._heap.update(key, self._priority(key))

    def on_use(self, key: bytes) -> None:
        self._heap.hold(key)

    def on_release(self, key: bytes) -> None:
        self._heap.unhold(key)

    def on_remove(self, key: bytes) -> None:
        h = self._heap.remove(key)[0]
        self.inflation = max(self.inflation, h)
        del self._freq[key], self._depth[key]

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        return self._heap.victim(evictable)

    def _priority(self, key: bytes) -> tuple[float, int]:
        value = self._freq[key] * self.model.value_per_byte(self._depth[key])
        return (self.inflation + value, next(self._clock))

    def __len__(self) -> int:
        return len(self._freq)
