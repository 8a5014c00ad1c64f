"""Structured outputs over real-world JSON schemas: which compile (and why the others are refused), and whether
what each compiled grammar lets through validates against its schema (`jsonschema`). JSON out.

    .venv/bin/python bench/schema_conformance.py --out out/schema_conformance.json        # the committed sample
    .venv/bin/python bench/schema_conformance.py --data DIR --per-subset 60                 # a JSONSchemaBench data/

Schemas: `tests/data/jsonschemabench_sample.json` (45 JSONSchemaBench schemas, its header says which and under what
licence), or `--data`, a checkout's `data/` folder of JSONSchemaBench (one folder per subset, one schema per file;
the first `--per-subset` files of each subset in name order).

Each schema is compiled as a request's `response_format` is (`structured.json_schema`, the server's compiler on the
bundled demo model's tokenizer). A compiled grammar is then walked to a complete document: at each step, the
tokens its mask allows, preferring the one that closes what is open (`"` inside a string, else `}` / `]` / `"`),
else a one-character token after which a closer is allowed, else any allowed one; with a fixed seed. A model's
samples are such walks with other preferences: the check is that every document the mask admits validates
(formats included, where `jsonschema` can check them). A walk that does not end within `--max-steps` (a pattern
such as an unanchored `wifi` that random characters seldom spell) is counted apart, never as valid.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import write_json  # noqa: E402
from sage_infer.structured.constraints import StructuredOutputError, json_schema  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "jsonschemabench_sample.json"


class Walker:
    """Walks compiled grammars of one tokenizer to complete documents (see the module's docstring)."""

    def __init__(self, tokenizer, vocab_size: int, seed: int = 0) -> None:
        pieces = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
        self.pieces = pieces + [""] * (vocab_size - len(pieces))
        self.vocab_size = vocab_size
        self.quote, close_object, close_array = (tokenizer.token_to_id(c) for c in ('"', "}", "]"))
        self.outside = [close_object, close_array, self.quote]
        self.single = np.array([len(p) == 1 and p != "\\" for p in self.pieces])  # never a voluntary escape
        self.seed = seed

    def walk(self, ll, max_steps: int = 6000) -> list[int] | None:
        """The token ids of one complete document the matcher `ll` (an `llguidance.LLMatcher`) admits; None when
        none was reached within `max_steps`."""
        rng = np.random.default_rng(self.seed)
        ids: list[int] = []
        in_string = escaped = False
        for _ in range(max_steps):
            if ll.is_accepting() or ll.is_stopped():
                return ids
            bits = np.unpackbits(np.frombuffer(ll.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[:self.vocab_size])
            if not len(allowed):
                return None
            closers = [self.quote] if in_string else self.outside
            open_ones = [c for c in closers if bits[c]]
            if open_ones and rng.random() < 0.9:
                token = open_ones[0]
            else:
                single = allowed[self.single[allowed]]
                near = [int(c) for c in single if any(ll.validate_tokens([int(c), k]) == 2 for k in closers)]
                token = int(rng.choice(near if near else single if len(single) else allowed))
            if not ll.consume_token(token):
                raise AssertionError(f"the mask allowed token {token} the matcher refuses: {ll.get_error()}")
            ids.append(token)
            for ch in self.pieces[token]:
                if escaped:
                    escaped = False
                elif ch == "\\" and in_string:
                    escaped = True
                elif ch == '"':
                    in_string = not in_string
        return None


def check(schema_id: str, schema, compiler, walker: Walker, tokenizer, max_steps: int = 6000) -> dict:
    """One schema's outcome: `compiled` and the walk's document valid / invalid / unfinished, or `refused` and
    the client's message."""
    import jsonschema

    try:
        matcher = compiler.matcher(json_schema(schema, whitespace_flexible=False))
    except StructuredOutputError as err:
        return {"id": schema_id, "outcome": "refused", "message": str(err), "param": err.param}
    ids = walker.walk(matcher.ll, max_steps)
    if ids is None:
        return {"id": schema_id, "outcome": "unfinished"}
    text = tokenizer.decode(ids)
    try:
        document = json.loads(text)
    except ValueError as err:
        return {"id": schema_id, "outcome": "invalid", "text": text, "error": f"not JSON: {err}"}
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    errors = [e.message for e in validator.iter_errors(document)]
    return {"id": schema_id, "outcome": "invalid" if errors else "valid", "text": text, "errors": errors[:3]}


def uses_named_feature(schema, message: str) -> bool:
    """Whether the keywords or formats a refusal names (``Unimplemented keys: ["not"]``, ``oneOf``, ``Unknown
    format: color``) are in the schema."""
    keys = re.search(r"Unimplemented keys: \[(.*)\]", message)
    named = json.loads(f"[{keys.group(1)}]") if keys else ["oneOf"] if "oneOf" in message else []
    found = re.search(r"Unknown format: (\S*)", message)
    named += [found.group(1)] if found else []
    text = json.dumps(schema)
    return bool(named) and all(f'"{name}"' in text for name in named)


def reason_of(message: str) -> str:
    """A refusal's message, grouped: the keyword or format it names, or its first words."""
    reason = message.split(": ", 1)[-1]
    for prefix in ("Unimplemented keys", "Unknown format"):
        if reason.startswith(prefix):
            return reason
    return " ".join(reason.split()[:6])


def load(data: Path | None, per_subset: int) -> dict[str, object]:
    if data is None:
        return json.loads(SAMPLE.read_text())["schemas"]
    schemas = {}
    for subset in sorted(p for p in data.iterdir() if p.is_dir()):
        for path in sorted(subset.glob("*.json"))[:per_subset]:
            schemas[f"{subset.name}/{path.stem}"] = json.loads(path.read_text())
    return schemas


def main(argv: list[str] | None = None) -> int:
    from sage_infer.models.loader import DEMO_MODEL_DIR
    from sage_infer.models.tokenizer import Tokenizer
    from sage_infer.structured.grammar import GrammarCompiler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="a JSONSchemaBench data/ folder (default: the committed sample)")
    parser.add_argument("--per-subset", type=int, default=60)
    parser.add_argument("--max-steps", type=int, default=6000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    walker = Walker(tokenizer, tokenizer.vocab_size)
    results = [check(k, s, compiler, walker, tokenizer, args.max_steps) for k, s in load(args.data,
                                                                                          args.per_subset).items()]
    by_subset: dict[str, Counter] = {}
    for result in results:
        by_subset.setdefault(result["id"].split("/")[0], Counter())[result["outcome"]] += 1
    summary = {"schemas": len(results), "outcomes": dict(Counter(r["outcome"] for r in results)),
               "by_subset": {k: dict(v) for k, v in by_subset.items()},
               "refusals": dict(Counter(reason_of(r["message"]) for r in results if r["outcome"] == "refused")
                                .most_common()),
               "invalid": [r for r in results if r["outcome"] == "invalid"]}
    print(json.dumps(summary, indent=1))
    if args.out:
        write_json(args.out, {"summary": summary, "results": results})
    return 1 if summary["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
