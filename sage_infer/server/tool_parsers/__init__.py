"""Tool-call parsers by name (``--tool-call-parser``), imported when first asked for, and the
format a chat template's own text shows (``auto``)."""

from __future__ import annotations

import importlib

from sage_infer.server.tool_parsers.base import ToolCall, ToolCallStream, ToolParser

TOOL_PARSERS: dict[str, str] = {
    "hermes": "sage_infer.server.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "sage_infer.server.tool_parsers.llama3_json:Llama3JsonToolParser",
    "mistral": "sage_infer.server.tool_parsers.mistral:MistralToolParser",
    "pythonic": "sage_infer.server.tool_parsers.pythonic:PythonicToolParser",
    "deepseek_v3": "sage_infer.server.tool_parsers.deepseek_v3:DeepSeekV3ToolParser",
}
ALIASES = {"qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
           "llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "deepseekv3": "deepseek_v3",
           "deepseek_v31": "deepseek_v3", "deepseekv31": "deepseek_v3"}
# text a chat template holds when it renders tools in a format: the first match names the parser
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
                     ("[func_name1(", "pythonic"), ("<|python_tag|>", "llama3_json"),
                     ('"parameters": d', "llama3_json"))


def tool_parser_names() -> list[str]:
    return sorted([*TOOL_PARSERS, *ALIASES])


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance by name; an unknown name is a ValueError listing the known ones."""
    target = TOOL_PARSERS.get(ALIASES.get(name, name))
    if target is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(tool_parser_names())}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()


def detect_tool_parser(template: str | dict | None) -> str | None:
    """The parser a chat template's own tool-call format needs, when its text shows one."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    for marker, name in _TEMPLATE_MARKERS:
        if any(marker in text for text in texts):
            return name
    return None


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "detect_tool_parser", "get_tool_parser",
           "tool_parser_names"]
