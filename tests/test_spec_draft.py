"""`speculative.method: draft_model`: a small model sharing the target's tokenizer proposes greedily from its own
paged KV; the target verifies. Greedy output is the target's alone, token for token; a seeded sampled request
draws the same tokens as without speculation; the draft's KV is rolled back to what the target kept and freed
when a sequence ends; a draft with another vocabulary or tokenizer is refused at start-up; the draft's pool holds
as many blocks as the target's, out of the same KV budget (an explicit kv_pool.num_blocks: on top of it)."""

from __future__ import annotations

import logging
import random

import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig, SpeculativeConfig
from sage_infer.errors import ConfigError
from sage_infer.models.loader import DEMO_DRAFT_DIR
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root / "target", "qwen3", seed=0)
    other = make_tiny_model(root / "other", "qwen3", seed=1, num_hidden_layers=1)  # same tokenizer, other weights
    wrong = make_tiny_model(root / "wrong", "qwen3", vocab_size=640)
    return target, other, wrong


def llm(target, draft=None, k: int = 4, **scheduler) -> LLM:
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k} if draft else {}
    config = ServeConfig.model_validate({"model": {"path": str(target), "dtype": "fp32"},
                                         "kv_pool": {"num_blocks": 128, "block_size": 16},
                                         "scheduler": {"max_num_seqs": 16, **scheduler},
                                         "speculative": speculative})
    return LLM(config=config, device="cpu")


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_tokens_are_the_targets_alone(models, which):
    target, other, _ = models
    draft = target if which == "same" else other
    batch = prompts(1, (3, 17, 40, 90))
    plain = [o.outputs[0].token_ids for o in llm(target).generate(batch, GREEDY)]
    speculating = llm(target, draft)
    got = [o.outputs[0].token_ids for o in speculating.generate(batch, GREEDY)]
    assert got == plain
    stats = speculating.engine.spec_stats
    assert stats.num_drafts > 0
    if which == "same":  # the target itself proposes: every proposal stands
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    proposer = speculating.engine.scheduler.proposer
    assert proposer.seqs == {} and proposer.blocks.num_used_blocks == 0  # every draft sequence freed
    speculating.engine.kv.block_manager.check_invariants()
    proposer.blocks.check_invariants()


def test_the_draft_keeps_only_the_kv_the_target_accepted(models):
    """With another model as draft some proposals are rejected: before each proposal the draft's computed tokens
    are cut back to a prefix of the target's tokens (never its last, whose logits propose), and its blocks cover
    exactly what it keeps."""
    target, other, _ = models
    speculating = llm(target, other, k=3)
    engine, proposer = speculating.engine, speculating.engine.scheduler.proposer
    keep, rollbacks = proposer._keep_common_prefix, []

    def checked(draft, token_ids):
        before = draft.num_computed_tokens
        keep(draft, token_ids)
        computed = draft.num_computed_tokens
        assert draft.token_ids == token_ids and computed < len(token_ids)
        assert len(draft.block_table) == -(-computed // proposer.block_size)
        rollbacks.append(computed < before)

    proposer._keep_common_prefix = checked
    engine.add_request("r", prompts(2, (30,))[0], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert any(rollbacks) and engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens
    assert proposer.blocks.num_used_blocks == 0


def test_a_seeded_sampled_request_draws_the_same_tokens_with_a_draft(models):
    target, other, _ = models
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=5, seed=11, ignore_eos=True)
    batch = prompts(3, (8, 33))
    plain = [o.outputs[0].token_ids for o in llm(target).generate(batch, params)]
    assert [o.outputs[0].token_ids for o in llm(target, target).generate(batch, params)] == plain
    assert [o.outputs[0].token_ids for o in llm(target, other).generate(batch, params)] == plain


def test_a_draft_that_does_not_share_the_tokenizer_or_has_no_model_is_refused(models):
    target, _, wrong = models
    with pytest.raises(ConfigError, match="speculative.model: the draft's vocabulary has 640 tokens"):
        llm(target, wrong)
    with pytest.raises(ValueError, match="needed by method draft_model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="needed by method draft_model"):
        SpeculativeConfig(method="ngram", model=str(target))


def test_a_steps_rows_are_proposed_together_one_forward_per_draft_token(models):
    """`propose_batch` runs the draft once per proposed token for all rows (the first pass also computes each
    row's prompt) and proposes what proposing row by row would."""
    target, other, _ = models
    proposer = llm(target, other, k=3).engine.scheduler.proposer
    run, calls = proposer.runner.run, []

    def counted(seqs, num_new_tokens):
        calls.append(len(seqs))
        return run(seqs, num_new_tokens)

    proposer.runner.run = counted
    rows = [(i, ids, 3, b"") for i, ids in enumerate(prompts(4, (5, 20, 33, 64)))]
    together = proposer.propose_batch(rows)
    assert calls == [4, 4, 4]
    for seq_id, *_ in rows:
        proposer.forget(seq_id)
    alone = [proposer.propose(*row) for row in rows]
    assert together == alone and all(len(tokens) == 3 for tokens in together)
    for seq_id, *_ in rows:
        proposer.forget(seq_id)
    assert proposer.blocks.num_used_blocks == 0


def test_the_shipped_draft_proposes_for_the_demo_model_and_greedy_output_is_the_demo_models():
    """The bundled draft (sage_infer/demo_model_draft) passes the start-up tokenizer check against the bundled
    demo model, has its proposals accepted, and leaves greedy output as without speculation."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = ["ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\n"]
    plain = LLM(None, dtype="fp32", device="cpu", kv_memory="64MiB").generate(prompt, params)
    speculating = LLM(None, dtype="fp32", device="cpu", kv_memory="64MiB", speculative_config={
        "method": "draft_model", "model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3})
    got = speculating.generate(prompt, params)
    assert got[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    stats = speculating.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


DEMO_DRAFT = {"method": "draft_model", "model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3}
DEMO_PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\n", "First Citizen:\n",
                "KING RICHARD III:\nNow is the winter of our discontent\n"]


def num_blocks_line(caplog) -> str:
    """The latest engine's start-up line for kv_pool.num_blocks."""
    return [r.getMessage() for r in caplog.records
            if r.name == "sage_infer.auto" and r.getMessage().startswith("kv_pool.num_blocks = ")][-1]


def test_with_a_byte_budget_the_draft_pool_comes_out_of_it_and_greedy_output_is_unchanged(caplog):
    """kv_pool.memory_budget holds both pools, as many blocks each: the target gets fewer blocks than it would
    alone, the start-up line gives the split, and greedy output is the target's alone."""
    caplog.set_level(logging.INFO, logger="sage_infer.auto")
    budget = 4 << 20
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(None, dtype="fp32", device="cpu", kv_memory=budget)
    speculating = LLM(None, dtype="fp32", device="cpu", kv_memory=budget, speculative_config=DEMO_DRAFT)
    engine, proposer = speculating.engine, speculating.engine.scheduler.proposer
    target_pool, draft_pool = engine.runner.pool, proposer.runner.pool
    assert draft_pool.num_blocks == target_pool.num_blocks < plain.engine.runner.pool.num_blocks
    assert target_pool.nbytes + draft_pool.nbytes <= budget
    assert budget - (target_pool.nbytes + draft_pool.nbytes) < target_pool.block_nbytes + draft_pool.block_nbytes
    line = num_blocks_line(caplog)
    assert f"share the budget, {target_pool.num_blocks} blocks each" in line
    assert f"target {target_pool.nbytes / 2**20:.1f} MiB, draft {draft_pool.nbytes / 2**20:.1f} MiB" in line

    expected = [o.outputs[0].token_ids for o in plain.generate(DEMO_PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in speculating.generate(DEMO_PROMPTS, params)] == expected
    assert engine.spec_stats.num_drafts > 0
    assert proposer.seqs == {} and proposer.blocks.num_used_blocks == 0
    engine.kv.block_manager.check_invariants()
    proposer.blocks.check_invariants()


def test_an_explicit_num_blocks_is_the_targets_and_the_draft_pool_of_as_many_comes_on_top(caplog):
    caplog.set_level(logging.INFO, logger="sage_infer.auto")
    speculating = LLM(None, dtype="fp32", device="cpu", num_blocks=40, speculative_config=DEMO_DRAFT)
    engine, proposer = speculating.engine, speculating.engine.scheduler.proposer
    assert engine.runner.pool.num_blocks == proposer.runner.pool.num_blocks == proposer.blocks.num_blocks == 40
    assert f"another {proposer.runner.pool.nbytes / 2**20:.1f} MiB" in num_blocks_line(caplog)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    speculating.generate(DEMO_PROMPTS, params)
    assert engine.spec_stats.num_drafts > 0 and proposer.blocks.num_used_blocks == 0
    engine.kv.block_manager.check_invariants()
    proposer.blocks.check_invariants()


def test_a_draft_that_cannot_be_read_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the draft was read")

    monkeypatch.setattr("sage_infer.engine.build.load_model", no_load)
    with pytest.raises(ConfigError, match="speculative.model: "):
        LLM(None, dtype="fp32", device="cpu", num_blocks=40,
            speculative_config={**DEMO_DRAFT, "model": str(tmp_path / "missing")})
