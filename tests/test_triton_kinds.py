"""The Triton paged kernels under a layer's attention kind (any sliding window, a shorter one than a block too, a logit
soft-cap, attention sinks, and all three) against the PyTorch math of `sage_infer.layers.attention_kinds` (the path
the backend took before the kernels took kinds): the decode kernel in place, split or not, and the prefill kernel over
every span of a step in one launch. Without a GPU the kernel code runs under Triton's interpreter (tests/conftest.py),
on small shapes."""

from __future__ import annotations

import pytest
import torch

from sage_infer.layers.attention_kinds import AttentionKind, kind_decode_attention
from sage_infer.layers.triton_paged import decode_attention, interpreting, triton
from tests import kv_fill
from tests.kv_fill import LAYER

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    triton is None or not (CUDA or interpreting()),
    reason="triton is not installed" if triton is None else "no CUDA GPU and TRITON_INTERPRET is not 1")
FP32 = dict(atol=2e-5, rtol=1e-5)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def kinds() -> list[AttentionKind]:
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) * 1.5
    return [AttentionKind(window=3), AttentionKind(window=21), AttentionKind(softcap=0.7),
            AttentionKind(sinks=sinks.to(DEVICE)), AttentionKind(window=5, softcap=5.0, sinks=sinks.to(DEVICE))]


def padded(tables):
    width = max(map(len, tables)) + 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_takes_any_window_softcap_and_sinks(splits):
    """Windows shorter than a block (ending inside the block they start in) and longer ones, rows shorter than the
    window; split contexts (a split before the window sees nothing; split 0 holds the sinks); the lse counts the
    sink as the CPU kernel's does."""
    lens, block = [1, 4, 9, 30, 90], 8
    pool, tables, contexts = kv_fill.filled_pool(lens, KV_HEADS, HEAD_DIM, block, torch.float32, 1, DEVICE)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device=DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    width = max(lens)
    keys = torch.stack([torch.cat([k, k.new_zeros(width - len(k), *k.shape[1:])]) for k, _ in contexts])
    values = torch.stack([torch.cat([v, v.new_zeros(width - len(v), *v.shape[1:])]) for _, v in contexts])
    for kind in kinds():
        out, lse = decode_attention(q, *pool.block_views(LAYER), padded(tables), lens_t, 0.3, splits=splits,
                                    kind=kind)
        cpu_kind = AttentionKind(kind.window, kind.softcap, None if kind.sinks is None else kind.sinks.cpu())
        want = kind_decode_attention(q.cpu(), keys, values, lens_t.cpu(), 0.3, cpu_kind)
        torch.testing.assert_close(out.cpu(), want, **FP32, msg=lambda m, k=kind: f"{k.describe()}: {m}")
        if kind.sinks is not None and kind.window is None and kind.softcap is None:
            scores = torch.einsum("hd,thd->ht", q[-1].cpu(),
                                  keys[-1].repeat_interleave(HEADS // KV_HEADS, dim=1)) * 0.3
            want_lse = torch.cat([scores, kind.sinks.cpu()[:, None]], 1).logsumexp(1)
            torch.testing.assert_close(lse[-1].cpu(), want_lse, atol=1e-4, rtol=1e-5)
