"""Teacher-forced scoring through the engine: what a compressed model and KV cache do to the next-token
distribution, measured on the engine's own forward pass (quantized weights, quantized pool).

Each window runs as two steps: its first token alone, then the rest as one chunk that reads *every*
key and value back from the pool (`paged_attention` gathers the whole context of a chunk with
earlier context). So every position attends to the KV as the pool stores it — quantized codes for
fp8/int8/int4 — as decode steps do, and a window costs two forward passes, not one per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence

_SCORING = SamplingParams(max_tokens=1, temperature=0)


@dataclass(frozen=True, slots=True)
class WindowScores:
    """Next-token log-probabilities of a batch of windows; `logits` kept when asked (for error metrics)."""

    nll: torch.Tensor  # [n, T - 1] fp32: -log p(token t + 1 | tokens <= t)
    logits: torch.Tensor | None  # [n, T - 1, vocab] fp32

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.double().mean().item())


@torch.inference_mode()
def score_windows(engine, windows: torch.Tensor, *, keep_logits: bool = False) -> WindowScores:
    """Teacher-forced next-token NLL of `windows` ([n, T] token ids) under `engine`'s model and KV pool.

    The engine must be idle (no request in flight); blocks come from its block manager and go back.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("score_windows needs an idle engine (requests are in flight)")
    runner, manager = engine.runner, engine.kv.block_manager
    n, length = windows.shape
    if length < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {length}")
    per_window = -(-length // runner.block_size)
    seqs = []
    for i, row in enumerate(windows.tolist()):
        seq = Sequence(-1 - i, f"score-{i}", 0, row, length, _SCORING, b"")
        seq.block_table = manager.allocate(per_window)
        seqs.append(seq)
    try:
        first = _forward(runner, seqs, [1] * n)  # [n, vocab]: position 0 of each window
        for seq in seqs:
            seq.num_computed_tokens = 1
        rest = _forward(runner, seqs, [length - 1] * n).view(n, length - 1, -1)
    finally:
        for seq in seqs:
            manager.free(seq.block_table)
    logits = torch.cat((first.unsqueeze(1), rest[:, :-1]), dim=1)  # [n, T - 1, vocab]: predicts tokens 1..T-1
    logprobs = torch.log_softmax(logits, dim=-1)
    nll = -logprobs.gather(-1, windows[:, 1:].unsqueeze(-1).to(logits.device)).squeeze(-1)
    return WindowScores(nll.cpu(), logits.cpu() if keep_logits else None)


def _forward(runner, seqs: list[Sequence], num_new_tokens: list[int]) -> torch.Tensor:
    """Logits of every new token of the step, ``[sum(num_new_tokens), vocab]`` fp32."""
    batch, meta = runner.prepare(seqs, num_new_tokens)
    hidden = runner.model(batch.input_ids, batch.positions, runner.pool, meta)
    return runner.model.compute_logits(hidden)
