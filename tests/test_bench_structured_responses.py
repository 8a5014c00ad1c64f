"""bench/structured_vs_vllm.py and bench/responses_vs_chat.py without a server: what counts as a valid constrained
output, the with ÷ without and sage ÷ vLLM medians, and what a run's requests say about its history hits."""

from __future__ import annotations

import json

import pytest

from bench.responses_vs_chat import later_steps
from bench.structured_vs_vllm import conforms, ratios, why_not

PERSON_OK = {"name": "Lear", "age": 80, "role": "king", "lines": ["Nothing will come of nothing"], "alive": False}


@pytest.mark.parametrize(("kind", "text", "valid"), [
    ("json_schema", json.dumps(PERSON_OK), True),
    ("json_schema", json.dumps({**PERSON_OK, "role": "jester"}), False),  # not in the enum
    ("json_schema", '{"name": "a\x01b", "age": 1, "role": "fool", "lines": [], "alive": true}', False),  # raw U+0001
    ("json_object", '{"a": 1}', True),
    ("json_object", "[1]", False),
    ("regex", "yes, the king.", True),
    ("regex", "yes, the king", False),
    ("choice", "ghost", True),
    ("choice", "Ghost", False),
])
def test_an_output_is_valid_only_when_it_is_what_its_constraint_asked_for(kind, text, valid):
    assert conforms(kind, text) is valid


def test_an_invalid_output_is_reported_with_the_validators_reason():
    assert why_not("json_schema", '{"name": "a\x01b"}').startswith("not JSON: Invalid control character")
    assert "'jester' is not one of" in why_not("json_schema", json.dumps({**PERSON_OK, "role": "jester"}))
    assert why_not("json_object", "[1]") == "a JSON list, not an object"


def _round(with_tok_s: float, without_tok_s: float) -> dict:
    return {"regex": {"tok_s": with_tok_s, "without_tok_s": without_tok_s, "with_over_without": with_tok_s /
                      without_tok_s, "mean_tokens": 128.0}}


def test_ratios_are_medians_of_the_paired_runs():
    rounds = {"sage": [_round(90, 100), _round(300, 200), _round(110, 100)],
              "vllm": [_round(45, 50), _round(100, 100), _round(50, 100)]}
    summary = ratios(rounds)
    assert summary["sage"]["regex"]["with_over_without"] == pytest.approx(1.1)  # of 0.9, 1.5, 1.1
    assert summary["vllm"]["regex"]["tok_s"] == 50
    assert summary["sage_over_vllm"]["regex"]["tok_s"] == pytest.approx(2.2)  # of 2.0, 3.0, 2.2


def _request(conversation: int, turn: int, prompt: int, output: int, cached: int | None, ttft_ms: float,
             error: str | None = None) -> dict:
    return {"conversation": conversation, "turn": turn, "prompt_tokens": prompt, "output_tokens": output,
            "cached_tokens": cached, "ttft_ms": ttft_ms, "error": error}


def test_later_steps_count_the_previous_steps_context_in_full_blocks_and_skip_first_steps():
    document = {"errors": {"HTTP 400: too long": 1}, "requests": [
        _request(0, 0, 40, 10, 0, 500.0),  # a first step: not counted
        _request(0, 1, 70, 10, 48, 100.0),  # previous context 50 -> 48 in full blocks of 16: all of it a hit
        _request(0, 2, 100, 10, 16, 300.0),  # previous context 80 -> 80: 16 of it a hit
        _request(1, 0, 40, 10, 0, 400.0),
        _request(1, 1, 70, 10, None, 200.0, error="HTTP 400: too long"),  # failed: not counted
    ]}
    steps = later_steps(document, block_size=16)
    assert steps["steps"] == 2
    assert steps["history_hit"] == pytest.approx((48 + 16) / (48 + 80))
    assert steps["computed_prompt_tokens"] == pytest.approx(((70 - 48) + (100 - 16)) / 2)
    assert steps["errors"] == 1 and steps["error_messages"] == {"HTTP 400: too long": 1}
