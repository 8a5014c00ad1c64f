import math
import random

import pytest
import torch

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p

VOCAB = 32


def run(logits, params, prompts=None, outputs=None, generators=None):
    batch = logits.shape[0]
    return Sampler()(
        logits,
        params,
        prompts if prompts is not None else [[] for _ in range(batch)],
        outputs if outputs is not None else [[] for _ in range(batch)],
        generators if generators is not None else [None] * batch,
    )


def seeded(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def logits():
    return torch.randn(4, VOCAB, generator=seeded(0)) * 3


def test_greedy_takes_argmax(logits):
    out = run(logits, [SamplingParams(temperature=0.0)] * 4)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_low_precision_logits_are_accepted(logits):
    out = run(logits.to(torch.bfloat16), [SamplingParams(temperature=0.0)] * 4)
    assert out.token_ids == logits.to(torch.bfloat16).float().argmax(dim=-1).tolist()


def test_caller_logits_are_not_modified(logits):
    before = logits.clone()
    run(logits, [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, top_p=0.5)] * 4, outputs=[[1, 2]] * 4)
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy(logits):
    out = run(logits, [SamplingParams(temperature=1.5, top_k=1)] * 4)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy(logits):
    for _ in range(20):
        out = run(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 4)
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_only_samples_from_the_k_best(logits):
    allowed = logits.topk(3, dim=-1).indices
    for _ in range(50):
        out = run(logits, [SamplingParams(temperature=5.0, top_k=3)] * 4)
        assert all(tok in allowed[i].tolist() for i, tok in enumerate(out.token_ids))


def test_min_p_filters_tokens_below_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {run(logits, [SamplingParams(min_p=0.4)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.15 and 0.05 are below 0.4 * 0.5


def test_greedy_and_sampled_rows_mix_in_one_batch(logits):
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(), SamplingParams(seed=1)]
    out = run(logits, params, generators=[None, None, None, seeded(1)])
    assert out.token_ids[:2] == logits[:2].argmax(dim=-1).tolist()


def draws(logits, params, generators, row, steps=10):
    """`steps` tokens for batch row `row`, reusing the same generators across steps."""
    return [run(logits, params, generators=generators).token_ids[row] for _ in range(steps)]


def test_seeded_request_is_reproducible(logits):
    params = [SamplingParams(seed=7)]
    first = draws(logits[:1], params, [seeded(7)], row=0)
    assert first == draws(logits[:1], params, [seeded(7)], row=0)
    assert len(set(first)) > 1  # it really samples


def test_seeded_request_ignores_batch_companions(logits):
    alone = draws(logits[1:2], [SamplingParams(seed=3)], [seeded(3)], row=0)
    params = [SamplingParams(), SamplingParams(seed=3), SamplingParams(temperature=0.0), SamplingParams(seed=9)]
    assert draws(logits, params, [None, seeded(3), None, seeded(9)], row=1) == alone


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.5]]).repeat(20_000, 1)
    temperature = 0.8
    torch.manual_seed(0)
    tokens = torch.tensor(run(logits, [SamplingParams(temperature=temperature)] * 20_000).token_ids)
    observed = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(logits[0].double() / temperature, dim=-1) * 20_000
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 18.47  # p = 0.001 for 4 degrees of freedom


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, VOCAB, generator=seeded(5))
    prompt, output = [3, 5, 5, 9], [9, 11, 30]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    got = apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=1.3)], [prompt], [output])
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_penalties_match_openai_formula():
    logits = torch.randn(2, VOCAB, generator=seeded(6))
    outputs = [[4, 4, 4, 7], []]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(presence_penalty=1.0)]
    got = apply_penalties(logits.clone(), params, [[1, 2], [4]], outputs)
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.25 + 0.5
    expected[0, 7] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(got, expected)  # row 1: prompt tokens are not penalized


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for i, p in enumerate(params):
        for t in set(prompts[i]) | set(outputs[i]):
            out[i, t] = out[i, t] / p.repetition_penalty if out[i, t] > 0 else out[i, t] * p.repetition_penalty
        for t in set(outputs[i]):
            out[i, t] -= outputs[i].count(t) * p.frequency_penalty + p.presence_penalty
    return out


def test_batched_penalties_match_a_per_row_reference():
    rng = random.Random(11)
    for _ in range(30):
        batch = rng.randrange(1, 6)
        logits = torch.randn(batch, VOCAB, generator=seeded(rng.randrange(1000))) * 3
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(12))] for _ in range(batch)]
        outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(12))] for _ in range(batch)]
        params = [
            SamplingParams(
                repetition_penalty=rng.choice([1.0, 0.8, 1.7]),
                presence_penalty=rng.choice([0.0, 0.7, -0.4]),
                frequency_penalty=rng.choice([0.0, 0.3, -1.2]),
            )
            for _ in range(batch)
        ]
        expected = reference_penalties(logits, params, prompts, outputs)
        torch.testing.assert_close(apply_penalties(logits.clone(), params, prompts, outputs), expected)


TOP_K_TOP_P = [(5, 1.0), (-1, 0.6), (8, 0.7), (VOCAB, 0.9), (3, 0.999), (-1, 1.0)]


def transformers_top_k_top_p(logits, top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    if top_k > 0:
        logits = TopKLogitsWarper(top_k)(None, logits)
    return TopPLogitsWarper(top_p)(None, logits) if top_p < 1.0 else logits


@pytest.mark.parametrize(("top_k", "top_p"), TOP_K_TOP_P)
def test_top_k_top_p_match_transformers(top_k, top_p):
    logits = torch.randn(6, VOCAB, generator=seeded(12)) * 2
    got = apply_top_k_top_p(logits.clone(), [SamplingParams(top_k=top_k, top_p=top_p)] * 6)
    torch.testing.assert_close(got, transformers_top_k_top_p(logits.clone(), top_k, top_p))


def test_mixed_top_k_top_p_rows_each_match_transformers():
    logits = torch.randn(len(TOP_K_TOP_P), VOCAB, generator=seeded(13)) * 2
    got = apply_top_k_top_p(logits.clone(), [SamplingParams(top_k=k, top_p=p) for k, p in TOP_K_TOP_P])
    for i, (k, p) in enumerate(TOP_K_TOP_P):
        torch.testing.assert_close(got[i : i + 1], transformers_top_k_top_p(logits[i : i + 1].clone(), k, p))


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    assert run(logits, params, outputs=[[0]]).token_ids == [1]


def test_logprobs_are_log_softmax_of_penalized_logits(logits):
    params = [SamplingParams(temperature=0.7, logprobs=5), SamplingParams(temperature=0.0, logprobs=0)] * 2
    out = run(logits, params)
    expected = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], expected[i, tok].item(), rel_tol=1e-5)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 5, 0]
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == expected[0].topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert all(lp <= 0.0 for lp in out.logprobs)


def test_top_logprobs_over_whole_vocab_sum_to_one():
    logits = torch.randn(1, 20, generator=seeded(8)) * 4
    out = run(logits, [SamplingParams(logprobs=20, repetition_penalty=1.5)], outputs=[[2, 3]])
    assert sum(math.exp(lp) for _, lp in out.top_logprobs[0]) == pytest.approx(1.0, abs=1e-5)
    assert sorted(t for t, _ in out.top_logprobs[0]) == list(range(20))


def test_logprobs_only_for_requests_that_ask(logits):
    out = run(logits, [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(), SamplingParams()])
    assert out.top_logprobs[1] == [] and len(out.top_logprobs[0]) == 2
