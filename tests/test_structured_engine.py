"""Structured outputs inside the engine: every output token is one the grammar allowed, also when speculative
decoding proposes tokens the grammar forbids, when sequences are preempted and recomputed, and when the prompt
comes from the prefix cache; and the constrained output is the same token for token in all those cases."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.models.loader import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from sage_infer.structured import choice, json_schema, regex
from sage_infer.structured.grammar import compiler_for

SCHEMA = {"type": "object", "properties": {"speaker": {"type": "string", "maxLength": 8},
                                           "act": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "exit": {"type": "boolean"}},
          "required": ["speaker", "act", "exit"], "additionalProperties": False}
PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\n", "First Citizen:\n"]
DRAFT = {"method": "draft_model", "model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3}


def engine(num_blocks: int = 128, speculative: dict | None = None, **scheduler) -> LLM:
    config = ServeConfig.model_validate({"model": {"path": str(DEMO_MODEL_DIR), "dtype": "fp32"},
                                         "kv_pool": {"num_blocks": num_blocks, "block_size": 16},
                                         "scheduler": {"max_num_seqs": 16, **scheduler},
                                         "speculative": speculative or {}})
    return LLM(config=config, device="cpu")


def constrained() -> SamplingParams:
    """Seeded sampling, two sequences per prompt: the same tokens whatever the batch, speculation or preemption."""
    return SamplingParams(max_tokens=60, temperature=0.9, seed=11, n=2, structured_outputs=json_schema(SCHEMA))


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def assert_in_grammar(llm: LLM, outputs) -> None:
    """Every output validates, and its tokens, replayed through a fresh matcher, are all allowed."""
    compiler = compiler_for(llm.engine.tokenizer, llm.engine.runner.model.config.vocab_size)
    for o in outputs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert compiler.matcher(json_schema(SCHEMA)).valid_prefix(c.token_ids) == len(c.token_ids)


@pytest.fixture(scope="module")
def plain():
    return engine()


@pytest.fixture(scope="module")
def reference(plain):
    """The constrained outputs without speculation, preemption or cached prefixes."""
    outputs = plain.generate(PROMPTS, constrained())
    assert plain.engine.scheduler.num_preemptions == 0
    return outputs


def test_the_outputs_follow_the_grammar(plain, reference):
    assert_in_grammar(plain, reference)
    assert len({c.text for o in reference for c in o.outputs}) > 1  # each sequence its own matcher and draws


@pytest.fixture(scope="module")
def speculating():
    return engine(speculative=DRAFT)


@pytest.mark.parametrize("cut_proposals", [True, False], ids=["cut-before-verify", "verify-alone"])
def test_speculative_decoding_never_keeps_a_token_the_grammar_forbids(monkeypatch, speculating, reference,
                                                                       cut_proposals):
    """The unconstrained draft model proposes freely. Cut at the grammar before the step or not, the verify step
    keeps only tokens the grammar allows (its rows are masked), so the output is exactly the non-speculative one."""
    if not cut_proposals:
        monkeypatch.setattr("sage_infer.scheduler.scheduler.grammar_allowed", lambda seq, proposals: proposals)
    stats = speculating.engine.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    outputs = speculating.generate(PROMPTS[:1], constrained())
    assert_in_grammar(speculating, outputs)
    assert texts(outputs) == texts(reference[:1])
    assert 0 < stats.num_accepted_tokens - accepted < stats.num_draft_tokens - drafted


def test_proposals_are_cut_at_the_first_token_the_grammar_forbids(plain):
    from sage_infer.core.sequence import Sequence
    from sage_infer.spec_decode.grammar import grammar_allowed

    tokenizer = plain.engine.tokenizer
    compiler = compiler_for(tokenizer, plain.engine.runner.model.config.vocab_size)
    seq = Sequence(0, "r", 0, [5], 1, SamplingParams(), b"", grammar=compiler.matcher(choice(["yes sir", "no"])))
    yes = tokenizer.encode("yes sir", add_special_tokens=False)
    assert grammar_allowed(seq, yes) == yes
    assert grammar_allowed(seq, yes[:1] + tokenizer.encode("!!", add_special_tokens=False)) == yes[:1]
    unconstrained = Sequence(1, "r", 0, [5], 1, SamplingParams(), b"")
    assert grammar_allowed(unconstrained, [7, 8, 9]) == [7, 8, 9]


def test_preempted_and_prefix_cached_sequences_keep_their_grammar(reference):
    """A pool too small for every sequence at once preempts and recomputes some; the matcher follows the output
    tokens, which preemption keeps, so nothing changes. The second run finds the prompts in the prefix cache."""
    llm = engine(num_blocks=12)
    first = llm.generate(PROMPTS, constrained())
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(PROMPTS, constrained())
    assert sum(o.metrics.num_cached_tokens for o in again) > 0
    for outputs in (first, again):
        assert_in_grammar(llm, outputs)
        assert texts(outputs) == texts(reference)


def test_a_regex_ends_the_sequence_when_complete_even_with_ignore_eos(plain):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, structured_outputs=regex("[A-Z]{3}"))
    out = plain.generate(PROMPTS[:1], params)[0].outputs[0]
    assert len(out.text) == 3 and out.text.isupper() and out.finish_reason == "stop"


def test_a_bad_constraint_is_refused_when_added(plain):
    from sage_infer.errors import RequestError

    with pytest.raises(RequestError, match="unsupported JSON schema feature"):
        plain.engine.add_request("bad", "x", SamplingParams(structured_outputs=json_schema({"not": {}})))
    assert "bad" not in plain.engine.requests
