"""Compiling constraints into grammars for one tokenizer, with a bounded cache and a bounded compile time.

A `StructuredOutputsParams` becomes an llguidance grammar (JSON schema, regex, choice, Lark/GBNF), checked and
turned into a template matcher once, then cached by the constraint's hash (`StructuredOutputsParams.key`):
every sequence that uses it gets a copy of the template (`deep_copy`, microseconds). A compile runs in a worker
thread under a timeout (llguidance drops the GIL while it builds) and under the library's own fuel limits, so a
schema built to compile for minutes is refused (`StructuredOutputError`) and never stalls other requests.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from sage_infer.core.structured_outputs import StructuredOutputsParams
from sage_infer.structured.constraints import StructuredOutputError, lark_literal
from sage_infer.structured.matcher import GrammarMatcher

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a template matcher each: kilobytes to a few MB)
DEFAULT_TIMEOUT_S = 10.0  # longest a compile may take before the request is refused
# JSON's layout. Any run of whitespace between tokens (JSON's own rule) lets a model drawn to blank lines spend
# its whole max_tokens there, and llguidance cannot bound a run; so by default a value is written on one line with
# json.dumps' separators, and with `whitespace_flexible=False` (vLLM's disable_any_whitespace) with none at all.
# A schema's own "x-guidance" options ({"whitespace_flexible": true}, ...) override both.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_COMPILE_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sage-grammar")


class TokenizerSource(Protocol):
    """What the compiler reads of a tokenizer (`sage_infer.models.tokenizer.Tokenizer` is one)."""

    eos_token_ids: list[int]

    def to_json(self) -> str: ...


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: `GrammarCompiler.compile` does)."""
    defaults = JSON_LAYOUT if spec.whitespace_flexible else JSON_COMPACT
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=defaults)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)
    except ValueError as err:
        raise StructuredOutputError(f"malformed JSON schema: {err}", spec.param) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        options = " | ".join(lark_literal(o) for o in json.loads(spec.spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {options}\n")
    text = spec.spec
    if "::=" in text:  # GBNF (llama.cpp / xgrammar) rather than Lark
        try:
            text = gbnf_to_lark(text)
        except Exception as err:  # noqa: BLE001 - the converter raises bare exceptions on bad input
            raise StructuredOutputError(f"cannot read the GBNF grammar: {err}", spec.param) from None
    return llguidance.LLMatcher.grammar_from_lark(text)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and one logits width (`vocab_size`: the model's, which may exceed
    the tokenizer's; ids past the tokenizer's are never allowed). Thread-safe: the server checks a request's
    constraint on its threads, the engine makes matchers on its own; both share the cache."""

    def __init__(self, tokenizer: TokenizerSource, vocab_size: int, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                                   eos_token=list(tokenizer.eos_token_ids) or None)
        self._cache: OrderedDict[str, llguidance.LLMatcher | StructuredOutputError] = OrderedDict()
        self._compiling: dict[str, Future] = {}
        self._lock = threading.RLock()  # a compile that ends at once stores its result from inside `compile`

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (a copy of the cached template)."""
        return GrammarMatcher(self.compile(spec).deep_copy())

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The template matcher of `spec`, compiled once; raises `StructuredOutputError` (with `spec.param`) for
        a malformed or unsupported constraint, or one still compiling after `timeout_s` (the compile goes on in
        the background, one per constraint, and a later request finds its result in the cache)."""
        key = spec.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            else:
                future = self._compiling.get(key)
                if future is None:
                    future = self._compiling[key] = _COMPILE_THREADS.submit(self._build, spec)
                    future.add_done_callback(lambda done: self._store(key, done))
        if found is None:
            try:
                found = future.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise StructuredOutputError(f"the grammar took longer than {self.timeout_s:g} s to compile; "
                                            "simplify it", spec.param) from None
        if isinstance(found, StructuredOutputError):
            raise StructuredOutputError(str(found), spec.param)  # the cached failure, named for this request
        return found

    def _store(self, key: str, done: Future) -> None:
        """A compile ended: keep its result (a template or the reason it failed), the least recently used out."""
        result = done.result() if done.exception() is None else \
            StructuredOutputError(f"the grammar failed to compile: {done.exception()}")
        with self._lock:
            self._compiling.pop(key, None)
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _build(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher | StructuredOutputError:
        try:
            text = grammar_text(spec)
        except StructuredOutputError as err:
            return err
        except Exception as err:  # noqa: BLE001 - the library's parse errors: the client's input was wrong
            return StructuredOutputError(_client_message(spec, str(err)), spec.param)
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            return StructuredOutputError(_client_message(spec, template.get_error()), spec.param)
        return template

    @property
    def num_cached(self) -> int:
        return len(self._cache)


_UNSUPPORTED = ("Unimplemented keys", "not supported", "only supported", "Unknown format")
_MAX_REASON = 300


def _client_message(spec: StructuredOutputsParams, error: str) -> str:
    """The library's reason, said as what is wrong with the request's constraint: a feature the library does not
    implement (a keyword, a format, a oneOf it cannot prove exclusive, a regex lookaround) or a malformed one."""
    what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    reason = lines[0] if lines else "unknown error"
    if reason.endswith(":") and len(lines) > 1:  # a regex error: its headline, the pattern, then the cause
        reason = f"{reason} {lines[-1].removeprefix('error: ')} in /{lines[1]}/"
    if len(reason) > _MAX_REASON:
        reason = reason[:_MAX_REASON - 3] + "..."
    if any(marker in error for marker in _UNSUPPORTED):
        return f"unsupported {what} feature: {reason}"
    return f"invalid {what}: {reason}"


_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: TokenizerSource, vocab_size: int) -> GrammarCompiler:
    """The one compiler (and cache) of this tokenizer and logits width in this process: the server's checks and
    the engine's matchers share it, so a constraint the server compiled costs the engine nothing."""
    with _COMPILERS_LOCK:
        per_tokenizer = _COMPILERS.setdefault(tokenizer, {})
        compiler = per_tokenizer.get(vocab_size)
        if compiler is None:
            compiler = per_tokenizer[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return compiler
