"""A model directory's tokenizer: `tokenizer.json` through the `tokenizers` library, special
tokens and the chat template from `tokenizer_config.json`, stop ids from the model configs.
Matches `transformers.AutoTokenizer` on encode, decode and `apply_chat_template(tokenize=False)`
without importing transformers."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

from sage_infer.models.token_bytes import max_bytes_per_token

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# variables `apply_chat_template` sets itself; template kwargs from a request may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages; the message is safe to show a client."""


class Tokenizer:
    """tokenizer.json via the `tokenizers` library + tokenizer_config.json (special tokens,
    chat template rendered with jinja2) + generation_config.json/config.json (eos ids).

    BOS/EOS come from tokenizer.json's post-processor (as in transformers); only when it has
    none are tokenizer_config's `add_bos_token`/`add_eos_token` applied. `vocab_size` counts
    added tokens (transformers' `len(tokenizer)`)."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, eos_token_ids: Sequence[int] = (), name: str = "") -> None:
        self.name = name or "tokenizer"
        self._tok = tokenizer
        self._tok.no_padding()
        self._tok.no_truncation()
        # Every `*_token` string in the config is a named special token (transformers puts the
        # model-specific ones, like `image_token`, into the chat template's variables too).
        self.special_tokens = {
            key: content
            for key, value in config.items()
            if key.endswith("_token") and (content := _token_content(value)) is not None
        }
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = [c for t in (extra.values() if isinstance(extra, dict) else extra) if (c := _token_content(t))]
        named = [*self.special_tokens.values(), *extra]
        self._add_special_tokens(named)
        if self._tok.post_processor is None:
            self._tok.post_processor = self._bos_eos_processor(config)
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"  # transformers skips the clean-up for BPE: it corrupts text
        )
        self.chat_template: str | dict[str, str] | None = _named_templates(config.get("chat_template"))
        self._compiled: dict[str, jinja2.Template] = {}

        self.bos_token_id = self._special_id("bos_token")
        self.pad_token_id = self._special_id("pad_token")
        eos_ids = [*eos_token_ids, self._special_id("eos_token")]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))
        added = [i for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special]
        special_ids = [*map(self.token_to_id, named), *added]
        self.all_special_ids: list[int] = list(dict.fromkeys(i for i in special_ids if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads a Hugging Face model directory. A missing tokenizer.json raises FileNotFoundError."""
        directory = Path(path).expanduser()
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: not found; the model directory needs a tokenizer.json")
        config = _read_json(directory / "tokenizer_config.json")
        if (template_file := directory / "chat_template.jinja").is_file():  # takes priority, as in transformers
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        elif "chat_template" not in config and (legacy := _read_json(directory / "chat_template.json")):
            config["chat_template"] = legacy.get("chat_template")
        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            model_config = _read_json(directory / name)
            for source in (model_config, model_config.get("text_config") or {}):
                eos = source.get("eos_token_id")
                eos_ids.extend([eos] if isinstance(eos, int) else eos or [])
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises a bare Exception
            raise ValueError(f"{tokenizer_file}: cannot load: {err}") from None
        return cls(backend, config, eos_ids, name=str(directory))

    # --- tokens -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, added special tokens included: what a grammar library reads
        to map its vocabulary to token bytes (`sage_infer.structured`)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str | None]:
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tok.id_to_token(i) for i in ids if i not in special]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # --- chat -------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], /, add_generation_prompt: bool = True, tools: list[dict] | None = None, *,
        template_kwargs: dict[str, Any] | None = None, **kwargs: Any,
    ) -> str:
        """Renders `messages` (OpenAI-style dicts) the way transformers'
        `apply_chat_template(tokenize=False)` does. Extra kwargs, and `template_kwargs` (a
        request's untrusted ones, passed as a dict so no key can collide with a parameter),
        reach the template as variables.

        Raises `ChatTemplateError` (a `ValueError`) when there is no template, a kwarg is
        reserved (`RESERVED_TEMPLATE_VARIABLES`) or the template's code fails on these
        messages (its text never carries a Python exception); jinja's `TemplateError`
        (raise_exception(), sandbox refusals) passes through with the template's words."""
        kwargs = {**(template_kwargs or {}), **kwargs}
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
        if reserved:
            raise ChatTemplateError(f"chat template arguments cannot set reserved name(s): {', '.join(reserved)}")
        try:
            source = self._template_source(tools)
        except ValueError as err:
            raise ChatTemplateError(str(err)) from None
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty list of messages")
        # transformers drops None values (OpenAI sends content=None next to tool_calls) and
        # copies reasoning under every name templates read it by.
        chat = []
        for message in messages:
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        try:
            if source not in self._compiled:
                self._compiled[source] = _jinja_env().from_string(source)
            variables = {**self.special_tokens, "documents": None, **kwargs}
            return self._compiled[source].render(
                messages=chat, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError:
            raise  # raise_exception(), undefined names, sandbox refusals: the template's own words
        except Exception:  # noqa: BLE001 - template code failed on this input (TypeError...): say so, not how
            raise ChatTemplateError("the chat template failed to render these messages") from None

    @functools.cached_property
    def max_bytes_per_token(self) -> float | None:
        """No token covers more than this many bytes of the UTF-8 text given to `encode`, so
        a text of N bytes has at least N / bound tokens; None when there is no such bound.
        See `sage_infer.models.token_bytes`."""
        return max_bytes_per_token(json.loads(self._tok.to_str()), self._tok.get_vocab(with_added_tokens=True))

    def _template_source(self, tools: list[dict] | None) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            template = None
        if not template:
            raise ValueError(f"{self.name} has no chat template; send a plain prompt instead of chat messages")
        return template

    # --- construction helpers -----------------------------------------------------------

    def _add_special_tokens(self, named: list[str]) -> None:
        """Registers the config's special tokens with the backend as transformers does on load,
        so they are matched whole in text and skipped on decode. (tokenizer_config's
        `added_tokens_decoder` mirrors tokenizer.json's added tokens, so it is not read.)"""
        known = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(named) if t not in known]
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

    def _bos_eos_processor(self, config: dict) -> processors.TemplateProcessing:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos = bool(config.get("add_bos_token")) and bos is not None
        add_eos = bool(config.get("add_eos_token")) and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        special = [(t, self._tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    def _special_id(self, attr: str) -> int | None:
        token = self.special_tokens.get(attr)
        return None if token is None else self._tok.token_to_id(token)


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config writes it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_templates(value: object) -> str | dict[str, str] | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template}."""
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t}
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read: {err}") from None
    return data if isinstance(data, dict) else {}


_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece-era space fixes)."""
    for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text


# --- jinja environment, as transformers builds it for chat templates ---------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here
    it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names: templates are untrusted code."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja's Namespace
        self = args[0]
        jinja2.utils.Namespace.__init__(self)
        for name, value in dict(*args[1:], **kwargs).items():
            self[name] = value

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """Jinja's own tojson escapes HTML characters and non-ASCII text; chat templates want neither."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env
