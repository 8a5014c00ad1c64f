"""`model.prefill_attention: sage` on a CPU: prefill spans and shared prefixes through sage's CPU flash kernel
(bf16 and fp32 models)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sage_infer.layers import cpu_kernels
from sage_infer.layers.attention import merge_attention
from sage_infer.layers.attention_backends.base import PrefillPart
from sage_infer.layers.attention_kinds import window_tiles


@dataclass(frozen=True)
class FlashPrefill(PrefillPart):
    """Prefill spans one by one over gathered context, and shared prefixes, through sage's CPU flash kernel."""

    name = "sage"
    flash = True
    windowed = True

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        return cpu_kernels.flash_attention(q, k_ctx, v_ctx, scale, causal=True)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.flash_attention(q, k_ctx, v_ctx, scale, causal=True)

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.flash_attention(q, keys, values, scale, causal=False)

    def attend_window(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float,
                      window: int) -> torch.Tensor:
        """A span of a sliding-window layer through the flash kernel, which takes no window: the queries in tiles
        of at most `window` rows (`window_tiles`); a tile's own keys causally; the `window - 1` keys before it,
        which its query ``t`` sees from the ``t``-th on, causally over both reversed (query ``t`` of ``T`` reversed
        is row ``T - 1 - t``, key ``u`` of ``W - 1`` is ``W - 2 - u``: "u >= t" becomes the lower-right causal
        "u' <= t' + (W - 1) - T"), the tile's last query left out when it sees none of them; merged by their
        log-sum-exp. q: [q_len, H, D]; k_ctx, v_ctx: [ctx_len, KvH, D] -> [q_len, H, D] in q's dtype."""
        offset = k_ctx.shape[0] - q.shape[0]
        out = torch.empty_like(q)
        for first, stop in window_tiles(offset, q.shape[0], window):
            rows = slice(first - offset, stop - offset)
            if stop <= window:  # every query sees every earlier key
                out[rows] = self.attend(q[rows], k_ctx[:stop], v_ctx[:stop], scale)
                continue
            tile_out, tile_lse = cpu_kernels.flash_attention(q[rows], k_ctx[first:stop], v_ctx[first:stop], scale,
                                                             causal=True)
            seeing = min(stop - first, window - 1)  # the tile's queries that see keys before it
            if seeing > 0:
                before = slice(first - window + 1, first)
                flipped, lse = cpu_kernels.flash_attention(q[rows][:seeing].flip(0), k_ctx[before].flip(0),
                                                           v_ctx[before].flip(0), scale, causal=True)
                tile_out[:seeing] = merge_attention(flipped.flip(0), lse.flip(0), tile_out[:seeing],
                                                    tile_lse[:seeing])
            out[rows] = tile_out.to(q.dtype)
        return out
