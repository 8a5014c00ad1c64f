"""Speculative decoding (n-gram proposals, exact verification): the same output as without it, in every mode
the engine serves, with the rejected rows' KV rolled back and nothing leaked."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig, SpeculativeConfig
from sage_infer.spec_decode import NgramProposer, SpecDecodeStats, SuffixProposer, accept, build_proposer
from sage_infer.spec_decode.base import PAUSE_STEPS
from tests.tiny_models import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# -- the proposer and the verifier on their own ---------------------------------------------------------------

def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The reference: for the longest n, the latest earlier occurrence of the last n tokens, and what followed it,
    copied on past the end from the copy itself."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                grown = list(tokens)
                for i in range(k):
                    grown.append(grown[start + n + i])
                return grown[len(tokens):]
    return []


def test_ngram_proposer_agrees_with_a_brute_force_search_as_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(30):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        proposer = NgramProposer(4, lo, hi)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 10))]
        for _ in range(40):  # the index grows by the tokens appended between proposals
            limit = rng.randint(0, 5)
            assert proposer.propose(trial, tokens, limit) == brute_force(tokens, min(4, limit), lo, hi)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_ngram_proposer_prefers_the_longest_then_the_latest_match():
    proposer = NgramProposer(3, 1, 3)
    # "7 8" occurs twice before the end; the longest suffix that occurs, "5 7 8", occurs once
    assert proposer.propose(0, [5, 7, 8, 1, 2, 7, 8, 3, 4, 5, 7, 8], 3) == [1, 2, 7]
    assert proposer.propose(1, [7, 8, 1, 7, 8, 2, 7, 8], 3) == [2, 7, 8]  # the latest "7 8"
    assert proposer.propose(2, [1, 2, 3, 4], 3) == []  # nothing repeats
    # a loop: the latest "1 2" is 2 tokens back, and the copy goes on past the end as the loop does
    assert proposer.propose(3, [9, 1, 2, 1, 2], 3) == [1, 2, 1]
    proposer.forget(0)
    assert 0 not in proposer._indexes


def test_adaptive_k_halves_on_nothing_accepted_and_grows_back_on_everything():
    proposer = NgramProposer(4, 1, 2, adaptive=True)
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert proposer.propose(0, tokens, 10) == [2, 3, 4, 5]
    proposer.observe(0, 4, 0)  # refused: k halves, and PAUSE_STEPS steps propose nothing before a probe
    assert [proposer.propose(0, tokens, 10) for _ in range(PAUSE_STEPS + 1)] == [[]] * PAUSE_STEPS + [[2, 3]]
    proposer.observe(0, 2, 0)  # the probe refused: twice the pause
    assert [proposer.propose(0, tokens, 10) for _ in range(2 * PAUSE_STEPS + 1)] == [[]] * (2 * PAUSE_STEPS) + [[2]]
    proposer.observe(0, 1, 0)  # k never below 1
    assert [proposer.propose(0, tokens, 10) for _ in range(4 * PAUSE_STEPS + 1)] == [[]] * (4 * PAUSE_STEPS) + [[2]]
    proposer.observe(0, 1, 1)  # accepted: no more pausing, k grows
    proposer.observe(0, 2, 1)  # partly accepted: unchanged
    assert proposer.propose(0, tokens, 10) == [2, 3]
    for _ in range(5):
        proposer.observe(0, 2, 2)
    assert proposer.propose(0, tokens, 10) == [2, 3, 4, 5]  # never above num_speculative_tokens
    fixed = NgramProposer(4, 1, 2)
    fixed.propose(0, tokens, 10)
    fixed.observe(0, 4, 0)
    assert fixed.propose(0, tokens, 10) == [2, 3, 4, 5]  # without adaptive: k stays


def test_accept_keeps_the_agreeing_prefix_then_the_targets_token():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the token after
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first disagreement ends it
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept([], [3]) == [3]


def test_stats_count_drafts_tokens_and_acceptance_by_position():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(2, 2)
    stats.record(3, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 4)
    assert stats.accepted_per_position == [2, 2, 0, 0]
    assert stats.mean_accepted_length == pytest.approx(1 + 4 / 3)


def test_config_refuses_a_bad_lookup_range_and_leaves_the_draft_model_to_the_engine():
    assert build_proposer(SpeculativeConfig()) is None
    assert build_proposer(SpeculativeConfig(method="draft_model", model="draft")) is None  # engine.build builds it
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)


def test_every_field_reaches_the_proposer():
    proposer = build_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                                                prompt_lookup_max=4, disable_by_batch_size=8, adaptive=True))
    assert (proposer.k, proposer.lookup_min, proposer.lookup_max, proposer.disable_by_batch_size,
            proposer.adaptive) == (3, 2, 4, 8, True)
    tokens = [9, 1, 2, 3, 4, 5, 6, 9, 1]
    assert proposer.propose(0, tokens, 10) == [2, 3, 4]  # num_speculative_tokens caps it
    assert NgramProposer(3, 3, 4).propose(0, tokens, 10) == []  # prompt_lookup_min: "9 1" is too short
    assert NgramProposer(3, 1, 1).propose(0, [4, 1, 7, 9, 1], 10) == [7, 9, 1]  # prompt_lookup_max: one token


def test_suffix_proposer_follows_the_majority_of_the_longest_matchs_occurrences():
    proposer = SuffixProposer(4, max_tree_depth=8, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.3)
    tokens = [1, 2, 3, 4, 7, 1, 2, 3, 4, 8, 1, 2, 9, 5, 1, 2]
    # "1 2" was followed by 3 twice and by 9 once (the latest): 3 (2 of 3); then 4; then 8 and 7 tie (1 of 2,
    # above 0.3): the later occurrence's 8; then 1
    assert proposer.propose(0, tokens, 10) == [3, 4, 8, 1]
    assert SuffixProposer(4, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.7).propose(
        0, tokens, 10) == []  # 2 of 3 agree on the first token: under 0.7


def test_suffix_proposer_prefers_the_longest_match_and_caps_by_the_spec_factor():
    proposer = SuffixProposer(8, max_tree_depth=16, max_cached_requests=0, max_spec_factor=1.0, min_token_prob=0.1)
    # the last three tokens 5 1 2 occur once (followed by 6 6 6); "1 2" alone is followed by 3 more often
    tokens = [1, 2, 3, 1, 2, 3, 5, 1, 2, 6, 6, 6, 0, 5, 1, 2]
    assert proposer.propose(0, tokens, 10) == [6, 6, 6]  # a 3-token match: at most 3 tokens (factor 1.0)
    # at depth 2 every "1 2" is the match: 3 (2 of 3), then 5 and 1 tie: the later occurrence's 5
    assert SuffixProposer(8, max_tree_depth=2, max_cached_requests=0).propose(0, tokens, 10) == [3, 5]
    assert proposer.propose(1, [4, 5, 6, 7], 10) == []  # no earlier occurrence


def test_suffix_proposer_learns_from_a_tenants_finished_requests_and_never_across_tenants():
    proposer = SuffixProposer(4, max_tree_depth=16, max_cached_requests=2, max_spec_factor=2.0)
    answer = [40, 41, 42, 43, 44, 45]
    proposer.propose(0, [7, 8, 9] + answer, 10, b"tenant-a")
    proposer.forget(0, b"tenant-a", answer)
    assert proposer.propose(1, [1, 2, 40, 41, 42], 10, b"tenant-a") == [43, 44, 45]  # from the earlier output
    assert proposer.propose(2, [1, 2, 40, 41, 42], 10, b"tenant-b") == []  # another tenant: nothing
    for seq_id in (3, 4):  # two newer outputs push the first one out (max_cached_requests=2)
        proposer.forget(seq_id, b"tenant-a", [50 + seq_id, 60, 61, 62])
    assert proposer.propose(5, [1, 2, 40, 41, 42], 10, b"tenant-a") == []
    assert proposer.propose(6, [9, 60, 61], 10, b"tenant-a") == [62]
    alone = SuffixProposer(4, max_cached_requests=0)
    alone.forget(0, b"tenant-a", answer)
    assert alone.propose(1, [1, 2, 40, 41, 42], 10, b"tenant-a") == []


def test_suffix_proposer_copies_past_the_end_of_a_short_loop():
    """A loop shorter than the match depth: its latest occurrence is the longest match and reaches the end after
    one period; the copy goes on from the proposal, as prompt lookup's does, instead of stopping there."""
    proposer = SuffixProposer(8, max_tree_depth=24, max_cached_requests=0, max_spec_factor=4.0)
    assert proposer.propose(0, [9, 8, 5, 6, 7, 5, 6, 7, 5, 6], 10) == [7, 5, 6, 7, 5, 6, 7, 5]
    assert proposer.propose(1, [3, 1, 4, 4, 4], 10) == [4] * 8
    # a tenant's corpus ends at a separator: nothing is read past an output's end
    shared = SuffixProposer(8, max_tree_depth=24, max_cached_requests=4, max_spec_factor=4.0)
    shared.forget(2, b"t", [20, 21, 22, 23])
    assert shared.propose(3, [1, 20, 21], 10, b"t") == [22, 23]


def test_every_suffix_field_reaches_the_proposer():
    proposer = build_proposer(SpeculativeConfig(
        method="suffix", num_speculative_tokens=3, suffix_decoding_max_tree_depth=5,
        suffix_decoding_max_cached_requests=7, suffix_decoding_max_spec_factor=1.5,
        suffix_decoding_min_token_prob=0.4, disable_by_batch_size=8, adaptive=True))
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.k, proposer.max_tree_depth, proposer.max_cached_requests, proposer.max_spec_factor,
            proposer.min_token_prob, proposer.disable_by_batch_size, proposer.adaptive) == (3, 5, 7, 1.5, 0.4, 8, True)


def test_suffix_proposer_agrees_with_a_brute_force_majority_walk():
    """Random sequences against a direct implementation of the rule on the sequence alone: the longest match
    (at most the depth) of the last tokens, then the majority continuation of all its occurrences."""
    rng = random.Random(1)

    def reference(tokens, limit, depth, min_prob):
        n = len(tokens)
        for m in range(min(depth, n - 1), 1, -1):
            node = [p for p in range(m, n) if tokens[p - m:p] == tokens[n - m:]]
            if node:
                break
        else:
            return []
        node = node[-64:]
        out = []
        for _ in range(min(limit, depth, m)):
            seq = tokens + out  # past the end an occurrence reads the proposal (an overlapping copy)
            votes = Counter(seq[p] for p in node)
            if not votes:
                break
            best = max(votes.values())
            token = next(seq[p] for p in reversed(node) if votes[seq[p]] == best)
            if best / len(node) < min_prob:
                break
            out.append(token)
            node = [p + 1 for p in node if seq[p] == token]
        return out

    for trial in range(40):
        proposer = SuffixProposer(6, max_tree_depth=6, max_cached_requests=0, min_token_prob=0.25)
        tokens = [rng.randrange(4) for _ in range(rng.randint(2, 8))]
        for _ in range(15):
            assert proposer.propose(trial, tokens, 6) == reference(tokens, 6, 6, 0.25), tokens
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 3))]


# -- the engine: identical output, clean pool -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "model", "llama")


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (a phrase said twice, a list), where prompt lookup proposes."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(5, 400) for _ in range(rng.randint(3, 12))]
        filler = [rng.randrange(5, 400) for _ in range(rng.randint(0, 20))]
        out.append(phrase + filler + phrase + filler[:3] + phrase[: rng.randint(1, len(phrase))])
    return out


def make_llm(model_dir, speculative: dict | None, **overrides) -> LLM:
    sections = {"model": {"path": str(model_dir), "dtype": "fp32"},
                "kv_pool": {"num_blocks": 256}, "speculative": dict(speculative or {})}
    for dotted, value in overrides.items():
        section, name = dotted.split("__")
        sections.setdefault(section, {})[name] = value
    return LLM(config=ServeConfig(**sections))


def run(llm: LLM, batch: list, params) -> list:
    outputs = llm.generate(batch, params)
    manager = llm.engine.kv.block_manager
    manager.check_invariants()
    assert manager.get_utilization() == 0.0, "a request leaked in-use blocks"
    return outputs


def completions(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

CASES = {  # name: (engine overrides, prompts, sampling params)
    "batch-1": ({}, prompts(1), GREEDY),
    "batch-16": ({}, prompts(16), GREEDY),
    "chunked-prefill": ({"scheduler__max_num_batched_tokens": 16}, prompts(8), GREEDY),
    "no-prefix-caching": ({"kv_pool__enable_prefix_caching": False}, prompts(8), GREEDY),
    "torch-attention": ({"model__attention": "torch", "model__decode_step": "python"}, prompts(8), GREEDY),
    "preemption": ({"kv_pool__num_blocks": 24, "scheduler__max_num_seqs": 16}, prompts(12), GREEDY),
    "int8-kv": ({"kv_pool__kv_dtype": "int8"}, prompts(8), GREEDY),
    "host-tier": ({"kv_pool__num_blocks": 40, "tiers__host_bytes": "16MiB"}, prompts(12) * 2, GREEDY),
    "n-2-logprobs": ({}, prompts(6), SamplingParams(n=2, max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)),
    "max-tokens-5": ({}, prompts(16), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
    "adaptive": ({"speculative__adaptive": True}, prompts(16), GREEDY),
    "penalties": ({}, prompts(8), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  repetition_penalty=1.02, frequency_penalty=0.05)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_is_token_identical_with_speculation(model_dir, case):
    overrides, batch, params = CASES[case]
    reference = completions(run(make_llm(model_dir, None, **overrides), batch, params))
    llm = make_llm(model_dir, NGRAM, **overrides)
    outputs = run(llm, batch, params)
    assert completions(outputs) == reference
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0, "no proposal was accepted: the case did not exercise speculation"
    if params.logprobs is not None:
        for output in outputs:
            for completion in output.outputs:
                assert len(completion.logprobs) == len(completion.token_ids)


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0}


@pytest.mark.parametrize("case", ["batch-16", "chunked-prefill", "preemption", "n-2-logprobs", "int8-kv", "adaptive"])
def test_greedy_output_is_token_identical_with_suffix_decoding(model_dir, case):
    overrides, batch, params = CASES[case]
    reference = completions(run(make_llm(model_dir, None, **overrides), batch, params))
    llm = make_llm(model_dir, SUFFIX, **overrides)
    assert completions(run(llm, batch, params)) == reference
    assert llm.engine.spec_stats.num_accepted_tokens > 0, "no proposal was accepted: speculation was not exercised"


def test_suffix_decoding_proposes_a_tenants_earlier_answer_and_not_another_tenants(model_dir):
    """Asked the same questions again, suffix decoding finds the earlier answers in the tenant's recent outputs:
    most of the second round's tokens are accepted proposals. Under another cache_salt none of that is seen."""
    batch = [[5 + (31 * p + 7 * j) % 390 for j in range(24)] for p in range(4)]  # no repeats within a prompt
    llm = make_llm(model_dir, SUFFIX)
    first = completions(run(llm, batch, GREEDY))
    stats = llm.engine.spec_stats
    before = stats.num_accepted_tokens
    assert completions(run(llm, batch, GREEDY)) == first
    again = stats.num_accepted_tokens - before
    assert again >= 0.6 * 4 * GREEDY.max_tokens, again  # (the first two tokens of each answer anchor the match)
    before = stats.num_accepted_tokens
    assert completions(llm.generate(batch, GREEDY, cache_salt="other-tenant")) == first
    elsewhere = stats.num_accepted_tokens - before  # only what each answer repeats of itself
    assert elsewhere < again / 2, (elsewhere, again)


def test_logprobs_with_speculation_equal_those_without(model_dir):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    batch = prompts(4, seed=3)
    plain = run(make_llm(model_dir, None), batch, params)
    spec = run(make_llm(model_dir, NGRAM), batch, params)
    for a, b in zip(plain, spec):
        for (lp_a, top_a), (lp_b, top_b) in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_b == pytest.approx(lp_a, abs=1e-4)
            assert [t for t, _ in top_b] == [t for t, _ in top_a]


def test_stop_strings_and_stop_tokens_end_a_sequence_inside_an_accepted_run(model_dir):
    """Several tokens come out of one step; the sequence ends at the first that ends it, and the rest are
    dropped, exactly as when the tokens come one step at a time."""
    batch = prompts(8, seed=5)
    plain_llm = make_llm(model_dir, None)
    free_run = run(plain_llm, batch, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stop_ids = sorted({o.outputs[0].token_ids[k] for o in free_run for k in (12, 20)})
    texts = [o.outputs[0].text for o in free_run]
    stops = sorted({t[len(t) // 2: len(t) // 2 + 3] for t in texts if len(t) > 8 and t[len(t) // 2:].strip()})[:4]
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=stop_ids),
                   SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stops),
                   SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stops,
                                  include_stop_str_in_output=True)):
        reference = completions(run(plain_llm, batch, params))
        llm = make_llm(model_dir, NGRAM)
        assert completions(run(llm, batch, params)) == reference
        assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert any(o.outputs[0].finish_reason == "stop" for o in run(plain_llm, batch, params))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_seeded_sampled_request_draws_the_same_tokens_with_speculation(model_dir, method):
    batch = prompts(8, seed=7)
    params = [SamplingParams(max_tokens=30, temperature=t, top_k=k, seed=100 + i, ignore_eos=True)
              for i, (t, k) in enumerate([(0.3, -1), (0.7, 5), (1.0, 3), (0.5, -1)] * 2)]
    reference = completions(run(make_llm(model_dir, None), batch, params))
    llm = make_llm(model_dir, {"ngram": NGRAM, "suffix": SUFFIX}[method])
    assert completions(run(llm, batch, params)) == reference
    if method == "suffix":  # asked again: the first answers, now in the tenant's outputs, are proposed
        assert completions(run(llm, batch, params)) == reference
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both accepted and rejected rows must occur"


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampling_with_speculation_keeps_the_targets_distribution(model_dir, method):
    """Unseeded sampling (the default generator) keeps the target's distribution. The prompt is the model's own
    greedy continuation, so sampled text tends to repeat it and lookup proposes at most steps; top-k 3 keeps the
    cells few. A chi-square test of homogeneity of the (token, next token) pairs of 800 samples with and
    without speculation: a verifier that kept proposals the target had not drawn (even only after a first
    accepted one) shows up there. The global seed is fixed, so the test is deterministic. Suffix decoding also
    proposes from the outputs of the requests that finished before (the same tenant)."""
    start = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13]
    greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompt = start + run(make_llm(model_dir, None), [start], greedy)[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=3, ignore_eos=True)
    pairs = []
    for speculative in (None, {"ngram": NGRAM, "suffix": SUFFIX}[method]):
        llm = make_llm(model_dir, speculative)
        torch.manual_seed(1234)
        samples = [o.outputs[0].token_ids for o in run(llm, [prompt] * 800, params)]
        pairs.append(Counter((tokens[i - 1], tokens[i]) for tokens in samples for i in range(1, len(tokens))))
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 800 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    keys = sorted(set(pairs[0]) | set(pairs[1]))
    keys = [k for k in keys if pairs[0][k] + pairs[1][k] >= 10]
    assert len(keys) >= 20
    p_value = chi_square_p_value([[counts[k] for k in keys] for counts in pairs])
    assert p_value > 0.01, f"token pairs differ with speculation (p = {p_value:.4g})"


def chi_square_p_value(table: list[list[int]]) -> float:
    """Pearson's chi-square test of homogeneity of a 2-row contingency table: the p-value (the chi-square
    distribution's survival function is the regularized upper incomplete gamma Q(df/2, x/2))."""
    counts = torch.tensor(table, dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = (counts.shape[0] - 1) * (counts.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def test_chi_square_p_value_matches_known_values():
    assert chi_square_p_value([[10, 20], [20, 10]]) == pytest.approx(0.00982, abs=1e-4)  # x2 = 6.667, df 1
    assert chi_square_p_value([[50, 50, 50], [50, 50, 50]]) == pytest.approx(1.0)


def test_disable_by_batch_size_proposes_nothing_while_that_many_sequences_run(model_dir):
    batch = prompts(6, seed=15)
    lengths = [24, 24, 24, 60, 60, 60]  # three finish early: then three run, under the limit of four
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    reference = completions(run(make_llm(model_dir, None), batch, params))
    llm = make_llm(model_dir, {**NGRAM, "disable_by_batch_size": 4})
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    speculated_with = []  # the running sequences before each step that carried proposals

    def recording():
        before = len(scheduler.running)
        batch = schedule()
        if any(seq.draft_token_ids for seq in batch.seqs):
            speculated_with.append(before)
        return batch

    scheduler.schedule = recording
    assert completions(run(llm, batch, params)) == reference
    assert speculated_with and all(n < 4 for n in speculated_with), speculated_with
    assert llm.engine.spec_stats.num_drafts > 0


def test_proposals_never_outrun_max_tokens_or_the_context(model_dir):
    llm = make_llm(model_dir, NGRAM, model__max_model_len=64)
    batch = [p[:40] for p in prompts(6, seed=9) if len(p) >= 30]
    outputs = run(llm, batch, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for prompt, output in zip(batch, outputs):
        assert len(prompt) + len(output.outputs[0].token_ids) == 64
        assert output.outputs[0].finish_reason == "length"
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_rejected_rows_never_enter_the_prefix_cache(model_dir):
    """After speculative runs, every registered block's tokens are what the sequences really produced: a
    second, non-speculative engine pass over the produced texts hits the cache and gives the same tokens."""
    llm = make_llm(model_dir, NGRAM)
    batch = prompts(6, seed=11)
    first = run(llm, batch, GREEDY)
    follow = [p + o.outputs[0].token_ids for p, o in zip(batch, first)]
    again = run(llm, follow, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    plain = run(make_llm(model_dir, None), follow, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert completions(again) == completions(plain)
    assert all(o.metrics.num_cached_tokens > 0 for o in again)


# -- over HTTP: the OpenAI API and /metrics -------------------------------------------------------------------

def test_the_server_answers_the_same_with_speculation_and_counts_it_in_metrics(model_dir):
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from sage_infer.server.metrics import StatsLog
    from tests.server_fixture import running_server

    batch = prompts(4, seed=13)
    answers = []
    for speculative in (None, NGRAM):
        with running_server(model_dir, speculative=speculative) as server:
            stats_log = StatsLog(server.app.state.metrics, server.backend)  # the line `sage llm serve` prints
            assert stats_log.line() is None  # nothing ran yet
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            done = [client.completions.create(model=server.model, prompt=p, max_tokens=30, temperature=0,
                                              logprobs=2, extra_body={"ignore_eos": True}) for p in batch]
            stream = client.completions.create(model=server.model, prompt=batch[0], max_tokens=30, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            answers.append(([(c.choices[0].text, c.usage.completion_tokens, c.choices[0].logprobs.tokens)
                             for c in done], streamed))
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
            counts = {name: sum(s.value for s in families[name].samples if s.name.endswith("_total"))
                      for name in ("sage:spec_decode_num_drafts", "sage:spec_decode_num_draft_tokens",
                                   "sage:spec_decode_num_accepted_tokens",
                                   "sage:spec_decode_num_accepted_tokens_per_pos")}
            stats = server.backend.engine.spec_stats
            assert counts == {"sage:spec_decode_num_drafts": stats.num_drafts,
                              "sage:spec_decode_num_draft_tokens": stats.num_draft_tokens,
                              "sage:spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
                              "sage:spec_decode_num_accepted_tokens_per_pos": stats.num_accepted_tokens}
            line = stats_log.line()
            assert line.startswith("sage: ") and "generation tok/s" in line and "running 0" in line
            assert stats_log.line() is None  # nothing since
            if speculative:
                assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
                mean = 1 + stats.num_accepted_tokens / stats.num_drafts
                assert f"mean accepted length {mean:.2f}" in line
            else:
                assert stats.num_drafts == 0 and "spec decode" not in line
            server.backend.engine.kv.block_manager.check_invariants()
    assert answers[0] == answers[1]
    assert answers[0][1] == answers[0][0][0][0]
