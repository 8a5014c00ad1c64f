"""Attention backends: the ways a step's attention runs over the paged KV pool, as objects chosen once at build.

An `AttentionBackend` is a decode part and a prefill part, named as the config names them:

- `model.attention: torch` -> `GatheredDecode`: decode rows over gathered copies of their blocks, PyTorch ops
  (the oracle).
- `model.attention: paged` -> `PagedDecode`: decode rows (and short chunks after cached context) read their
  blocks in place: the C++ kernel on a CPU, the Triton kernel on an NVIDIA GPU
  (`cpu_kernels.decode_attention_paged` dispatches by device); an int8 pool's codes and scales through
  `cpu_kernels.decode_attention_paged_int8` (CPU).
- `model.prefill_attention: torch` -> `TorchPrefill`: prefill spans one by one, PyTorch's SDPA (the oracle).
- `model.prefill_attention: sage` on a CPU -> `FlashPrefill`: prefill spans and shared prefixes through sage's
  CPU flash kernel.
- `model.prefill_attention: sage` on an NVIDIA GPU -> `TritonPrefill`: every prefill span of a step in one
  Triton launch per layer, reading its context in place.

`sage_infer.engine.build` decides which parts run here (each fast part only where it can, with a start-up line
saying why) and hands the backend to the `ModelRunner`, which shapes each step's `AttentionMetadata` for it
(`decode_in_place`, `prefill_in_place`, `supports_cascade`) and puts it in the metadata; every layer then calls
`paged_attention`, which is the backend's `forward`. A new device path (an Ascend or MLU kernel, a GPU flash
kernel) is a new part here and one choice in build, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sage_infer.core.kv_schema import KVDtype
from sage_infer.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    attention_with_lse,
    chunk_attention_lse,
    decode_attention_batched,
    decode_attention_scaled,
    merge_attention,
    prefill_attention,
    shared_keys_attention_lse,
)
from sage_infer.layers.cpu_kernels import decode_attention_paged, decode_attention_paged_int8, flash_attention

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


# -- decode parts ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GatheredDecode:
    """Decode rows over gathered copies of their blocks, padded per group (the oracle)."""

    name = "torch"
    in_place = False  # the runner sorts decode rows into groups of similar context length

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
        """q: [b, H, D] -> [b, H, D] in q's dtype."""
        # masked SDPA is fast on fp32 K/V and 5-6x slower on bf16 here; bf16/fp16 and quantized pools widen
        # their context once to fp32 and use two matmuls instead (docs/benchmarks.md, "decode attention")
        if pool.schema.dtype is KVDtype.FP32:
            keys, values = pool.gather_blocks(layer, group.block_tables, q.dtype)
            return decode_attention_batched(q, keys, values, group.context_lens, scale)
        levels, scales = pool.gather_block_levels(layer, group.block_tables)
        return decode_attention_scaled(q, levels, scales, group.context_lens, scale)

    def attend_lse(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A shared prefix's suffixes: q: [b, H, D] -> (out [b, H, D] float32, lse [b, H])."""
        keys, values = pool.gather_blocks(layer, group.block_tables, q.dtype)  # [b, W, KvH, D]
        b, num_heads, head_dim = q.shape
        grouped = q.view(b, keys.shape[2], -1, head_dim)  # [b, KvH, G, D]
        positions = torch.arange(keys.shape[1], device=q.device)
        mask = (positions[None, :] < group.context_lens[:, None])[:, None, None, :]  # [b, 1, 1, W]
        out, lse = attention_with_lse(grouped, keys.transpose(1, 2), values.transpose(1, 2), scale, mask)
        return out.reshape(b, num_heads, head_dim), lse.reshape(b, num_heads)


@dataclass(frozen=True)
class PagedDecode(GatheredDecode):
    """Decode rows read their context in place from the pool's blocks, all rows in one group: the C++ kernel on
    a CPU, the Triton kernel on an NVIDIA GPU. The pool must have block views (a float pool), or int8 block
    views on a CPU (the int8 kernel: codes widened in registers, each token's scales on its score and
    probability)."""

    name = "paged"
    in_place = True  # also: chunks of at most IN_PLACE_CHUNK_ROWS after cached context become decode rows

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
        return self.attend_lse(q, pool, layer, group, scale)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if pool.supports_block_views:
            return decode_attention_paged(q, *pool.block_views(layer), group.block_tables, group.context_lens, scale)
        return decode_attention_paged_int8(q, *pool.int8_block_views(layer), group.block_tables, group.context_lens,
                                           scale)


# -- prefill parts -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TorchPrefill:
    """Prefill spans one by one over their context (this step's keys, or gathered from the pool), PyTorch's
    SDPA; shared prefixes and suffixes with their log-sum-exp in PyTorch (the oracle)."""

    name = "torch"
    in_place = False  # spans with earlier context get their slots gathered (`AttentionMetadata.prefill_slots`)
    flash = False  # the C++ decode step attends a shared prefix with sage's flash kernel
    supports_cascade = True  # shared prefixes attended once by all their sequences (`SharedPrefix`)

    def attend_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                     meta: AttentionMetadata, out: torch.Tensor, scale: float) -> None:
        """Every span of `meta.prefills` into `out` (q's rows, q's dtype)."""
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.context_len == span.q_len:  # nothing cached before: the keys are this step's own
                k_ctx, v_ctx = k[rows], v[rows]
            else:
                slots = meta.prefill_slots[span.slot_start : span.slot_start + span.context_len]
                k_ctx, v_ctx = pool.gather_slots(layer, slots, q.dtype)
            out[rows] = self.attend(q[rows], k_ctx, v_ctx, scale)

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        """One span, causal to the lower right: q [q_len, H, D]; k/v [ctx_len, KvH, D] -> q's dtype."""
        return prefill_attention(q, k_ctx, v_ctx, scale)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A shared prefix's suffix span: (out float32, lse), causal to the lower right."""
        return chunk_attention_lse(q, k_ctx, v_ctx, scale)

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every participant's rows over the shared keys, no mask: (out float32, lse)."""
        return shared_keys_attention_lse(q, keys, values, scale)


@dataclass(frozen=True)
class FlashPrefill(TorchPrefill):
    """Sage's CPU flash kernel for prefill spans and shared prefixes (bf16 and fp32 models)."""

    name = "sage"
    flash = True

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        return flash_attention(q, k_ctx, v_ctx, scale, causal=True)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return flash_attention(q, k_ctx, v_ctx, scale, causal=True)

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return flash_attention(q, keys, values, scale, causal=False)


@dataclass(frozen=True)
class TritonPrefill(TorchPrefill):
    """Every prefill span of a step in one Triton launch per layer, reading its context in place from the pool's
    blocks (`AttentionMetadata.paged_prefill`; an NVIDIA GPU, a float pool). It reads each row's shared prefix in
    place too, so there is no cascade."""

    name = "sage"
    in_place = True
    supports_cascade = False

    def attend_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                     meta: AttentionMetadata, out: torch.Tensor, scale: float) -> None:
        from sage_infer.layers.triton_paged import prefill_attention as prefill_attention_paged  # imports triton

        batch = meta.paged_prefill
        prefill_attention_paged(q, *pool.block_views(layer), out, batch.block_tables, batch.spans, batch.tiles,
                                scale)


# -- the two together --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionBackend:
    """A decode part and a prefill part; `forward` is one layer's attention of a step."""

    decode: GatheredDecode = field(default_factory=GatheredDecode)
    prefill: TorchPrefill = field(default_factory=TorchPrefill)

    @property
    def name(self) -> str:
        return f"decode {self.decode.name}, prefill {self.prefill.name}"

    @property
    def decode_in_place(self) -> bool:
        return self.decode.in_place

    @property
    def prefill_in_place(self) -> bool:
        return self.prefill.in_place

    @property
    def supports_cascade(self) -> bool:
        return self.prefill.supports_cascade

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store this step's K/V of `layer` in `pool`, then attend. q: [T, H, D]; k, v: [T, KvH, D] -> [T, H, D]."""
        pool.store(layer, k, v, meta.slot_mapping)
        if (group := meta.pure_decode_group()) is not None:  # no row gather, no scatter back
            return self.decode.attend(q, pool, layer, group, scale)
        out = torch.empty_like(q)
        if meta.prefills:
            self.prefill.attend_spans(q, k, v, pool, layer, meta, out, scale)
        for group in meta.decode_groups:
            out[group.rows] = self.decode.attend(q[group.rows], pool, layer, group, scale)
        if meta.shared is not None:
            out[meta.shared.rows] = self.cascade(q, k, v, pool, layer, meta, scale).to(q.dtype)
        return out

    def cascade(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of the participants of `meta.shared` (K/V of this step already stored).

        q: [T, H, D]; k, v: [T, KvH, D] (this step's) -> [N, H, D] float32 for ``meta.shared.rows``.
        The shared keys are gathered once and attended by all N query rows in one call; each
        participant's suffix is attended as the reference path would (with a lower-right causal
        mask for prefill chunks); the two are merged by their log-sum-exp.
        """
        shared = meta.shared
        q_rows = q[shared.rows]
        keys, values = pool.gather_blocks(layer, shared.block_ids[None], q.dtype)  # [1, num_tokens, KvH, D]
        prefix_out, prefix_lse = self.prefill.prefix_lse(q_rows, keys[0], values[0], scale)  # before the next gather
        suffix_out, suffix_lse = torch.empty_like(prefix_out), torch.empty_like(prefix_lse)
        for span in shared.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.context_len == span.q_len:  # the suffix is this step's own tokens
                own = shared.rows[rows]
                k_ctx, v_ctx = k[own], v[own]
            else:
                slots = meta.prefill_slots[span.slot_start : span.slot_start + span.context_len]
                k_ctx, v_ctx = pool.gather_slots(layer, slots, q.dtype)
            suffix_out[rows], suffix_lse[rows] = self.prefill.attend_lse(q_rows[rows], k_ctx, v_ctx, scale)
        for group in shared.decode_groups:
            suffix_out[group.rows], suffix_lse[group.rows] = self.decode.attend_lse(q_rows[group.rows], pool, layer,
                                                                                    group, scale)
        return merge_attention(prefix_out, prefix_lse, suffix_out, suffix_lse)


REFERENCE = AttentionBackend()  # PyTorch ops only: what every faster part is tested against
PAGED_DECODE = AttentionBackend(decode=PagedDecode())  # the decode kernel in place, the reference prefill
