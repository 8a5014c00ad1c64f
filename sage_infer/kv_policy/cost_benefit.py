"""`CostBenefitModel`: is loading a KV block from a tier cheaper than recomputing it?

Recompute cost is the prefill FLOPs of the block's tokens at their position in the
prompt, run at the preset's dense BF16 TFLOP/s times an MFU factor. Load cost is the
block's KV bytes over the tier's link. Both are first-order estimates: they ignore
kernel launch and per-transfer latency, and assume the load is not overlapped with
compute. They rank tiers; they do not predict a TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass

from sage_infer.config.hardware import HardwareProfile

TIERS = ("device", "host", "disk", "remote")

# Prefill is a large GEMM workload: well-tuned engines reach 40-60% of peak dense
# BF16 on long prompts. 0.5 is the middle of that range.
DEFAULT_MFU = 0.5
# One PCIe Gen4 x4 NVMe SSD reads ~5-7 GB/s sequentially; 5 GB/s is the low end.
DEFAULT_DISK_GB_S = 5.0
# Presets without `device.dense_bf16_tflops` (the cpu preset): a rough sustained BF16
# GEMM rate of a 2-socket AVX-512 server. A placeholder; pass `tflops=` to override.
FALLBACK_TFLOPS = 5.0


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizes a KV block and its prefill: defaults are Llama-3-8B (GQA, bf16).

    `num_params` counts the weights every token multiplies (embeddings excluded by
    convention, the LM head included: close enough for a cost model).
    """

    num_layers: int = 32
    hidden: int = 4096
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: float = 2  # per K/V element, scales included (0.5+ for int4 KV)
    num_params: float = 8.03e9

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    def prefill_flops(self, tokens: int, context_tokens: int) -> float:
        """FLOPs to prefill `tokens` tokens after `context_tokens` cached ones.

        Weights: 2 * params per token. Attention: QK^T and AV cost 2 * hidden FLOPs each
        per (query, key) pair per layer; token i attends to `context_tokens + i + 1` keys (causal).
        """
        pairs = tokens * context_tokens + tokens * (tokens + 1) / 2
        return 2.0 * self.num_params * tokens + 4.0 * self.num_layers * self.hidden * pairs


class CostBenefitModel:
    """Load-vs-recompute arithmetic for one hardware profile and one model shape."""

    def __init__(
        self,
        profile: HardwareProfile,
        model: ModelShape | None = None,
        *,
        mfu: float = DEFAULT_MFU,
        disk_gb_s: float = DEFAULT_DISK_GB_S,
        tflops: float | None = None,
    ) -> None:
        if not 0 < mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {mfu}")
        if disk_gb_s <= 0:
            raise ValueError(f"disk_gb_s must be > 0, got {disk_gb_s}")
        self.profile = profile
        self.model = model or ModelShape()
        self.mfu = mfu
        self.disk_gb_s = disk_gb_s
        self.tflops = tflops or profile.device.dense_bf16_tflops or FALLBACK_TFLOPS

    @property
    def effective_flops(self) -> float:
        """FLOP/s prefill actually reaches: peak dense x MFU."""
        return self.tflops * 1e12 * self.mfu

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K and V for `tokens` tokens across all layers."""
        return tokens * self.model.kv_bytes_per_token

    def prefill_flops(self, block_tokens: int, context_tokens: int) -> float:
        """FLOPs to prefill `block_tokens` tokens after `context_tokens` cached ones (`ModelShape.prefill_flops`)."""
        return self.model.prefill_flops(block_tokens, context_tokens)

    def recompute_seconds(self, block_tokens: int, depth: int, *, context_tokens: int | None = None) -> float:
        """Seconds to recompute a block at position `depth` of its prompt.

        The context before it defaults to `depth * block_tokens` (all earlier blocks
        full); pass `context_tokens` for a partial block.
        """
        context = depth * block_tokens if context_tokens is None else context_tokens
        return self.prefill_flops(block_tokens, context) / self.effective_flops

    def tier_gb_s(self, tier: str) -> float:
        """Bandwidth into device memory from `tier`, GB/s (inf for device, 0 when absent).

        host: the host link. disk: the NVMe figure, capped by the host link it crosses.
        remote: this device's share of the node's NICs (GPUDirect: NIC -> device).
        """
        profile = self.profile
        if tier == "device":
            return float("inf")
        if tier == "host":
            return profile.host_link.bandwidth_gb_s
        if tier == "disk":
            return min(self.disk_gb_s, profile.host_link.bandwidth_gb_s)
        if tier == "remote":
            node_gb_s = sum(nic.count * nic.gbit_s for nic in profile.inter_node_nics) / 8
            return node_gb_s / profile.device.devices_per_node
        raise ValueError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")

    def load_seconds(self, tier: str, nbytes: int) -> float:
        """Seconds to bring `nbytes` of KV from `tier` into device memory (inf if unreachable)."""
        gb_s = self.tier_gb_s(tier)
        if gb_s == float("inf"):
            return 0.0
        return nbytes / (gb_s * 1e9) if gb_s > 0 else float("inf")

    def saved_seconds(self, tier: str, block_tokens: int, depth: int, *, context_tokens: int | None = None) -> float:
        """Prefill seconds a hit in `tier` saves: recompute minus load (negative when loading loses)."""
        recompute = self.recompute_seconds(block_tokens, depth, context_tokens=context_tokens)
        return recompute - self.load_seconds(tier, self.kv_bytes(block_tokens))

    def worth_loading(self, tier: str, block_tokens: int, depth: int) -> bool:
        """True when loading the block from `tier` beats recomputing it."""
        return self.saved_seconds(tier, block_tokens, depth) > 0
