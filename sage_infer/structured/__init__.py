"""Structured outputs: constrain a sequence's tokens to a JSON schema, any JSON object, a regex, a list of
choices or a grammar, with llguidance (a maintained grammar library; no hand-written schema compiler here).

- `constraints`: builders of `StructuredOutputsParams` (`json_schema`, `any_of_json_schemas`, `json_object`,
  `regex`, `choice`, `constraints.grammar` (not re-exported here: `structured.grammar` is the compiler's
  module), `tagged_json` for tool-call blocks, `lark_json`/`lark_literal` to compose
  grammars) and `StructuredOutputError` (a 400 naming `param`).
- `request_constraint.constraint_from_request`: the OpenAI/vLLM request fields as one constraint.
- `grammar.GrammarCompiler` / `compiler_for`: compile once per constraint hash (bounded cache, bounded time).
- `matcher.GrammarMatcher`: one sequence's grammar state, advanced by each token it emits.
- `masks.PendingMasks`: a step's token bitmasks, computed while the model runs; the sampler applies them.

Set `SamplingParams.structured_outputs` to a constraint and the engine does the rest: every sequence of the
request gets its own matcher, each sampled row is masked before sampling, proposals of speculative decoding are
cut at the first token the grammar forbids, and a completed grammar ends the sequence (finish_reason "stop").
"""

from __future__ import annotations

from sage_infer.core.structured_outputs import StructuredOutputsParams
from sage_infer.structured.constraints import (
    StructuredOutputError,
    any_of_json_schemas,
    choice,
    json_object,
    json_schema,
    lark_json,
    lark_literal,
    regex,
    tagged_json,
)

__all__ = [
    "StructuredOutputError", "StructuredOutputsParams", "any_of_json_schemas", "choice", "json_object", "json_schema",
    "lark_json", "lark_literal", "regex", "tagged_json",
]
