"""Compiling constraints with llguidance for the demo model's byte-level BPE vocabulary: the cache and its
bound, the compile-time bound, and the grammars the builders make (what tool calling constrains with)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from sage_infer.models.loader import DEMO_MODEL_DIR
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.structured import StructuredOutputError, choice, json_schema, regex, tagged_json
from sage_infer.structured import grammar as grammar_module
from sage_infer.structured.constraints import grammar
from sage_infer.structured.grammar import GrammarCompiler
from sage_infer.structured.masks import fill_bitmask, forbidden_tokens


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_size=4)


def accepts(compiler, tokenizer, spec, text: str) -> bool:
    """Whether the grammar takes `text`, tokenized as the model would write it, to its end."""
    matcher = compiler.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.valid_prefix(ids) == len(ids) and matcher.ll.consume_tokens(ids) and matcher.ll.is_accepting()


def test_a_constraint_compiles_once_and_the_cache_is_bounded(compiler):
    specs = [regex(f"[a-z]{{{n}}}") for n in range(1, 7)]
    for spec in specs:
        compiler.matcher(spec)
    assert compiler.num_cached == 4  # the least recently used went
    template = compiler.compile(specs[-1])
    assert compiler.compile(regex("[a-z]{6}")) is template  # same constraint, same hash: no compile


def test_a_compile_past_the_time_bound_is_refused_and_lands_in_the_cache_later(tokenizer):
    """The compile workers are held busy, so the compile cannot end in time, whatever this machine's speed."""
    hurried = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=0.05)
    spec = json_schema({"type": "object", "properties": {"k": {"type": "string", "pattern": "[a-z]{2,9}"}}})
    release = threading.Event()
    busy = [grammar_module._COMPILE_THREADS.submit(release.wait) for _ in range(2)]
    try:
        with pytest.raises(StructuredOutputError, match="longer than") as refused:
            hurried.compile(spec)
        assert refused.value.param == "response_format.json_schema.schema"
        assert hurried.num_cached == 0
    finally:
        release.set()
    for done in busy:
        done.result()
    deadline = time.monotonic() + 30
    while hurried.num_cached == 0:  # its one compile ran once the workers were free
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert hurried.compile(spec) is not None


def test_json_keeps_the_schemas_key_order_on_one_line(compiler, tokenizer):
    spec = json_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "boolean"}},
                        "required": ["b", "a"], "additionalProperties": False})
    assert accepts(compiler, tokenizer, spec, '{"b": 1, "a": true}')
    assert not accepts(compiler, tokenizer, spec, '{"a": true, "b": 1}')
    assert not accepts(compiler, tokenizer, spec, '{\n\n\n"b": 1, "a": true}')  # no runs of blank lines
    compact = json_schema(json.loads(spec.spec), whitespace_flexible=False)
    assert accepts(compiler, tokenizer, compact, '{"b":1,"a":true}')


def test_tool_call_blocks_choices_and_gbnf(compiler, tokenizer):
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}},
            "required": ["name", "arguments"]}
    calls = tagged_json("<tool_call>\n", [call], "\n</tool_call>", max_items=2)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona"}}\n</tool_call>'
    assert accepts(compiler, tokenizer, calls, one)
    assert accepts(compiler, tokenizer, calls, one + "\n" + one)
    assert not accepts(compiler, tokenizer, calls, one + "\n" + one + "\n" + one)
    assert not accepts(compiler, tokenizer, calls, one.replace("get_weather", "rm_rf"))
    assert accepts(compiler, tokenizer, choice(["Enter Ghost", "Exeunt"]), "Exeunt")
    assert accepts(compiler, tokenizer, grammar('root ::= "to be" | "not to be"'), "not to be")


def test_masks_allow_only_what_the_grammar_allows_after_each_proposed_token(compiler, tokenizer):
    matcher = compiler.matcher(choice(["yes", "no"]))
    first = tokenizer.encode("yes", add_special_tokens=False)[0]
    bitmask = fill_bitmask([(matcher, [first])], tokenizer.vocab_size)
    allowed = [[t for t in range(tokenizer.vocab_size) if row[t // 32] >> (t % 32) & 1] for row in bitmask.tolist()]
    assert first in allowed[0] and all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode(
        [t])) for t in allowed[0])
    assert all(("yes".removeprefix(tokenizer.decode([first]))).startswith(tokenizer.decode([t])) for t in allowed[1])
    assert matcher.valid_prefix([first]) == 1  # the masks after the proposal left the matcher where it was


def test_logits_past_the_tokenizers_vocabulary_are_always_forbidden(tokenizer):
    """A model's logits may be wider than its tokenizer (padded embeddings): those ids are no tokens."""
    wider = GrammarCompiler(tokenizer, tokenizer.vocab_size + 64)
    matcher = wider.matcher(regex("[a-z ]{1,40}"))
    forbidden = forbidden_tokens(fill_bitmask([(matcher, [])], wider.vocab_size), wider.vocab_size)[0]
    assert forbidden[tokenizer.vocab_size:].all() and not forbidden[: tokenizer.vocab_size].all()
