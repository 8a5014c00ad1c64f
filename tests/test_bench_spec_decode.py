"""bench/spec_decode.py's oracle proposer (the target's own greedy continuation, truncated to a set acceptance) and
the oracle rows of the bench on the bundled demo model (no timing here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench.spec_decode import OracleProposer, build, main
from sage_infer import LLM, SamplingParams

PROMPT, OUTPUT = [1, 2, 3], [4, 5, 6, 7, 8]


def test_the_oracle_proposes_the_next_k_tokens_of_the_reference():
    oracle = OracleProposer(3, [(PROMPT, OUTPUT)], acceptance=1.0, vocab_size=10)
    assert oracle.propose(0, PROMPT + [4], limit=10) == [5, 6, 7]
    assert oracle.propose(0, PROMPT + [4, 5, 6, 7], limit=10) == [8]  # the reference ends
    assert oracle.propose(0, PROMPT + [4], limit=2) == [5, 6]


def test_acceptance_zero_makes_every_proposed_token_wrong():
    oracle = OracleProposer(3, [(PROMPT, OUTPUT)], acceptance=0.0, vocab_size=10)
    proposal = oracle.propose(0, PROMPT + [4], limit=10)
    assert len(proposal) == 3 and all(p != t for p, t in zip(proposal, [5, 6, 7]))


def test_a_sequence_off_its_reference_or_of_another_prompt_gets_no_proposal():
    oracle = OracleProposer(3, [(PROMPT, OUTPUT)], acceptance=1.0, vocab_size=10)
    assert oracle.propose(0, PROMPT + [9], limit=10) == []
    assert oracle.propose(1, [7, 7, 7, 4], limit=10) == []


def test_proposals_are_truncated_to_the_acceptance_on_average_seeded_and_nested():
    long_output = list(range(4000))
    high, low, again = (OracleProposer(4, [(PROMPT, long_output)], a, vocab_size=8192, seed=3)
                        for a in (0.7, 0.4, 0.4))

    def kept(oracle: OracleProposer) -> list[int]:  # the correct leading tokens of the proposal at each position
        out = []
        for done in range(1, 3996):
            proposal = oracle.propose(done, PROMPT + long_output[:done], limit=10)
            assert len(proposal) == 4
            out.append(next((i for i, (p, t) in enumerate(zip(proposal, long_output[done:])) if p != t), 4))
        return out

    k_high, k_low = kept(high), kept(low)
    assert k_low == kept(again)
    assert all(lo <= hi for hi, lo in zip(k_high, k_low))
    assert sum(k_high) / (4 * len(k_high)) == pytest.approx(0.7, abs=0.02)
    assert sum(k_low) / (4 * len(k_low)) == pytest.approx(0.4, abs=0.02)


def test_every_other_step_proposes_nothing():
    oracle = OracleProposer(2, [(PROMPT, OUTPUT)], acceptance=1.0, vocab_size=10, every_other=True)
    row = (0, PROMPT + [4], 10, b"")
    assert [oracle.propose_batch([row]) for _ in range(4)] == [[[]], [[5, 6]], [[]], [[5, 6]]]


def test_the_engine_is_pinned_to_the_reference_where_the_target_would_leave_it():
    prompt = "ROMEO: What light through yonder window breaks?"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(None, dtype="float32", kv_memory="64MiB")
    off = llm.generate([prompt], params)[0]
    vocab_size = llm.engine.model_info().vocab_size
    llm.close()
    reference = list(off.outputs[0].token_ids)
    reference[5] = (reference[5] + 1) % vocab_size  # a token the target would not choose
    oracle = OracleProposer(2, [(off.prompt_token_ids, reference)], 1.0, vocab_size)
    args = SimpleNamespace(model=None, dtype="float32", device=None, kv_memory="64MiB")
    llm = build(args, None, oracle)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == reference
    llm.close()
    assert oracle.forced >= 1


def test_the_oracle_rows_accept_all_or_nothing_and_keep_the_tokens_of_off(tmp_path):
    threads = torch.get_num_threads()
    try:
        main(["--batch", "1", "--k", "2", "--max-tokens", "16", "--repeats", "1", "--threads", "1",
              "--workloads", "free", "--methods", "oracle", "--oracle-acceptance", "1.0", "0", "--dtype", "float32",
              "--kv-memory", "64MiB", "--json", str(tmp_path / "out.json")])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "out.json").read_text())
    rows = {row["variant"]: row for row in report["results"]}
    assert set(rows) == {"off", "oracle-a1.0-k2", "oracle-a0.0-k2", "oracle-a0.0-k2-adaptive"}
    every = rows["oracle-a1.0-k2"]
    assert every["proposed"] > 0 and every["accepted"] == every["proposed"] and every["acceptance"] == 1.0
    for name in ("oracle-a0.0-k2", "oracle-a0.0-k2-adaptive"):
        assert rows[name]["proposed"] > 0 and rows[name]["accepted"] == 0
    # adaptive k halves after a step that accepted nothing: fewer tokens proposed for as many verify steps
    assert rows["oracle-a0.0-k2-adaptive"]["proposed"] < rows["oracle-a0.0-k2"]["proposed"]
    for name, row in rows.items():
        assert row["same_tokens"] == "1/1", name
        assert row["forced"] == (None if name == "off" else 0), name  # fp32: the target never left off's tokens
    (cost,) = report["verify_steps"]
    assert (cost["k"], cost["query_rows"]) == (2, 3)
    assert cost["decode_steps"] > 0 and cost["verify_steps"] > 0
