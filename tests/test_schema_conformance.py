"""Structured outputs over real-world JSON schemas: 45 of JSONSchemaBench, committed with their source and licence
(`tests/data/jsonschemabench_sample.json`). Each either compiles, and a document its grammar admits validates with
`jsonschema`, or is refused naming a feature the schema uses. In process through the server's compiler on the demo
model's tokenizer (`bench/schema_conformance.py` walks each grammar to a complete document). Over HTTP, through the
official openai client: `tests/test_structured_server.py`."""

from __future__ import annotations

import json

import pytest

from bench.schema_conformance import SAMPLE, Walker, check, uses_named_feature
from sage_infer.models.loader import DEMO_MODEL_DIR
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.structured.grammar import GrammarCompiler

SCHEMAS = json.loads(SAMPLE.read_text())


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    walker = Walker(tokenizer, tokenizer.vocab_size)
    return {k: check(k, schema, compiler, walker, tokenizer) for k, schema in SCHEMAS["schemas"].items()}


def test_the_sample_is_jsonschemabench_under_its_licence():
    assert "JSONSchemaBench" in SCHEMAS["source"] and SCHEMAS["licence"].startswith("MIT")
    assert len(SCHEMAS["schemas"]) == 45 and len({k.split("/")[0] for k in SCHEMAS["schemas"]}) == 9


def test_each_schema_compiles_and_its_documents_validate_or_is_refused_naming_a_feature_it_uses(outcomes):
    for schema_id, result in outcomes.items():
        assert result["outcome"] in ("valid", "refused"), result  # never invalid, and every walk ended here
        if result["outcome"] == "refused":
            assert result["param"] == "response_format.json_schema.schema"
            assert result["message"].startswith("unsupported JSON schema feature: ")
            assert uses_named_feature(SCHEMAS["schemas"][schema_id], result["message"]), result
    compiled = [r for r in outcomes.values() if r["outcome"] == "valid"]
    assert len(compiled) >= 0.8 * len(outcomes)  # real-world schemas are mostly served
