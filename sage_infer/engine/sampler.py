"""Turns one row of logits per running request into one token per request.

Order, as in vLLM: the grammar's token mask (structured outputs) -> penalties (repetition, presence,
frequency) -> greedy rows take the argmax of the penalized logits -> temperature -> top-k -> top-p ->
min-p -> sample. Everything is vectorized across the batch; only seeded rows draw their noise one row at a
time, from their own `torch.Generator`, so a seeded request samples the same tokens whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.structured.masks import TokenMask

# Below this a temperature's distribution is a one-hot in float32 anyway; dividing by it
# would only overflow the logits to inf.
_MIN_TEMPERATURE = 1e-5
LOGPROB_FLOOR = -9999.0  # the logprob reported for a token with none (masked by a grammar)


@dataclass(slots=True)
class SamplerOutput:
    """`token_ids[i]` is request i's token. `logprobs[i]` is its log-probability and
    `top_logprobs[i]` the request's top-N `(token_id, logprob)` pairs, best first, both under
    `log_softmax` of the logits *after penalties, before temperature/top-k/top-p/min-p* (what
    vLLM reports as raw logprobs). Both are None unless some request asked for logprobs; rows
    that did not ask get `[]` in `top_logprobs`."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Stateless: call it with the step's logits and each row's parameters and history."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        token_mask: TokenMask | None = None,
    ) -> SamplerOutput:
        """logits: [batch, vocab] in any float dtype (computed in float32); the other
        arguments have one entry per row. `token_mask`: the tokens each constrained row's grammar allows."""
        batch = logits.shape[0]
        assert len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators) == batch
        device = logits.device
        logits = logits.to(torch.float32, copy=True)  # never edit the caller's tensor in place
        if token_mask is not None:
            apply_token_mask(logits, token_mask)
        logits = apply_penalties(logits, params, prompt_token_ids, output_token_ids)

        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            temperature = [1.0 if g else max(p.temperature, _MIN_TEMPERATURE) for p, g in zip(params, greedy)]
            scaled = apply_top_k_top_p(logits / _row_values(temperature, device), params)
            probs = apply_min_p(torch.softmax(scaled, dim=-1), params)
            sampled = sample_from_probs(probs, generators, greedy)
            greedy_mask = torch.tensor(greedy, device=device)
            token_ids = torch.where(greedy_mask, logits.argmax(dim=-1), sampled) if any(greedy) else sampled

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist())
        return _with_logprobs(token_ids, raw_logprobs, params)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """Sets to -inf every token a constrained row's grammar forbids. logits: [batch, vocab] float32, edited in
    place; `mask.forbidden[i]` ([rows, vocab] bool, unpacked from the grammar's bitmask while the model ran) is
    for row `mask.rows[i]`."""
    forbidden = mask.forbidden.to(logits.device, non_blocking=True)
    if len(mask.rows) == logits.shape[0]:  # every row constrained (rows ascend): no gather
        return logits.masked_fill_(forbidden, float("-inf"))
    rows = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition penalty (HF `RepetitionPenaltyLogitsProcessor`: over the set of prompt and
    output tokens, positive logits are divided by it, negative ones multiplied), then
    OpenAI's `logit -= count * frequency_penalty + (count > 0) * presence_penalty` over output
    tokens. logits: [batch, vocab] float32, edited in place and returned.

    Works on the [batch, num_tokens] ids by gather/scatter rather than on [batch, vocab] masks:
    histories are far shorter than a 150k vocabulary."""
    use_rep = [p.repetition_penalty != 1.0 for p in params]
    use_freq_pres = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
    device = logits.device
    if any(use_rep):
        # Rows without the penalty contribute no ids, so their long prompts cost nothing.
        ids, valid = _padded_ids([p + o if on else [] for p, o, on in zip(prompt_token_ids, output_token_ids, use_rep)])
        ids, nonempty = ids.to(device), valid[:, :1].to(device)
        # An empty row's ids are all padding: penalty 1 makes its writes no-ops.
        penalty = _row_values([p.repetition_penalty for p in params], device) * nonempty + (1.0 - nonempty)
        seen = logits.gather(1, ids)
        logits.scatter_(1, ids, torch.where(seen > 0, seen / penalty, seen * penalty))
    if any(use_freq_pres):
        ids, valid = _padded_ids([o if on else [] for o, on in zip(output_token_ids, use_freq_pres)])
        ids, valid = ids.to(device), valid.to(device)
        frequency = _row_values([p.frequency_penalty for p in params], device)
        logits.scatter_add_(1, ids, -frequency * valid)  # once per occurrence: count * penalty
        presence = _row_values([p.presence_penalty for p in params], device) * valid[:, :1]
        logits.scatter_(1, ids, logits.gather(1, ids) - presence)  # once per distinct token
    return logits


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k, then outside its top-p nucleus; the
    most likely token always survives. logits: [batch, vocab], already temperature-scaled.

    When every row has a top-k, only the best max(k) logits are sorted (`topk`): a full
    sort of a 150k vocabulary costs far more and is needed only for top-p without top-k."""
    use_k = any(p.top_k > 0 for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if not use_k and not use_p:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    truncated = max(k) < vocab
    if truncated:
        sorted_logits, sorted_idx = logits.topk(max(k), dim=-1)  # sorted, best first
    else:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_logits.shape[1], device=device).unsqueeze(0)
    remove = rank >= torch.tensor(k, device=device).unsqueeze(1)
    if use_p:
        top_p = _row_values([p.top_p for p in params], device)
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of strictly better tokens
        # As in HF/vLLM, a token goes once the better ones already reach top_p. Rows with
        # top_p == 1 are left alone: rounding in the cumsum could otherwise clip their tail.
        remove |= (mass_before >= top_p) & (top_p < 1.0)
    remove[:, 0] = False
    if truncated:
        kept = sorted_logits.masked_fill(remove, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, kept)
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))


def apply_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zeroes tokens whose probability is below `min_p` times the row's top probability.
    probs: [batch, vocab]; the result is left unnormalised (sampling does not need it)."""
    if not any(p.min_p > 0.0 for p in params):
        return probs
    threshold = probs.amax(dim=-1, keepdim=True) * _row_values([p.min_p for p in params], probs.device)
    return probs.masked_fill(probs < threshold, 0.0)


def sample_from_probs(
    probs: torch.Tensor, generators: list[torch.Generator | None], skip: list[bool] | None = None
) -> torch.Tensor:
    """One draw per row via the exponential race: argmax(p / q) with q ~ Exp(1) picks token i
    with probability p_i (the Gumbel-max trick without logs). Rows with a generator draw their
    own q, so their choice depends only on their own probabilities and generator state; the
    other rows share one draw from the default RNG. Rows flagged in `skip` (greedy) consume
    nothing from their generator. probs: [batch, vocab] -> [batch] int64."""
    q = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None and not (skip and skip[i])]
    if len(seeded) < len(generators):
        q.exponential_()
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    # An exact 0 draw would turn a masked token's 0/0 into NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def skip_draws(generator: torch.Generator, vocab: int, rows: int, device: torch.device) -> None:
    """Advance `generator` as `sample_from_probs` does for `rows` sampled rows of a `vocab`-wide batch (one
    float32 exponential draw per vocab entry per row): a speculative verify step rewinds a seeded sequence's
    generator and replays the draws of the rows it kept."""
    noise = torch.empty(vocab, dtype=torch.float32, device=device)
    for _ in range(rows):
        noise.exponential_(generator=generator)


def _row_values(values: list[float], device: torch.device) -> torch.Tensor:
    """One float32 per row, shaped [batch, 1] to broadcast over the vocab or ids."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _padded_ids(token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, width] int64 ids and a float32 0/1 mask of the real ones. Each row is padded
    with its own first id, so a padding slot scatters the same value as the real slot for
    that id; an empty row is all id 0 and its caller must make its writes no-ops."""
    width = max(1, max(len(ids) for ids in token_ids))
    padded = torch.zeros(len(token_ids), width, dtype=torch.long)
    valid = torch.zeros(len(token_ids), width, dtype=torch.float32)
    for i, ids in enumerate(token_ids):
        if ids:
            padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            padded[i, len(ids) :] = ids[0]
            valid[i, : len(ids)] = 1.0
    return padded, valid


def _with_logprobs(token_ids: torch.Tensor, logprobs: torch.Tensor, params: list[SamplingParams]) -> SamplerOutput:
    """logprobs: [batch, vocab] log_softmax of the penalized logits. A token a grammar forbids has -inf, reported
    as LOGPROB_FLOOR (vLLM's -9999.0): JSON has no infinity."""
    logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_n = max(p.logprobs or 0 for p in params)
    top_values, top_ids = logprobs.topk(max_n, dim=-1)  # max_n == 0 gives [batch, 0]
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    top = [list(zip(top_ids[i][: p.logprobs or 0], top_values[i][: p.logprobs or 0])) for i, p in enumerate(params)]
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=chosen, top_logprobs=top)
