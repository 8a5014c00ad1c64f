"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of a list of strings, or a
grammar. The engine compiles it (`sage_infer.structured`) into one grammar matcher per sequence and masks every
token the grammar forbids before sampling."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint: `kind` in KINDS and its `spec` (a JSON schema serialized in its own key order, a regex, the
    choices as a JSON list, a Lark or GBNF grammar; "" for json_object). `param` names the request field it came
    from, for errors. JSON is written on one line, with ", " and ": " as separators; `whitespace_flexible=False`
    allows no whitespace at all (vLLM's `disable_any_whitespace`). Build one with `sage_infer.structured`'s
    helpers (`json_schema`, `choice`, ...)."""

    kind: str
    spec: str
    whitespace_flexible: bool = True
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def key(self) -> str:
        """A stable hash of what is compiled (kind, spec, whitespace): the compiled-grammar cache's key."""
        data = json.dumps([self.kind, self.spec, self.whitespace_flexible], ensure_ascii=False)
        return hashlib.sha256(data.encode("utf-8")).hexdigest()
