"""Turn a pydantic `ValidationError` into the one line a user reads.

``presets/my.yaml:7: memory.hbm_gb: expected a number greater than 0, got -5``
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable

from pydantic import BaseModel, SecretStr, ValidationError


def format_validation_error(
    err: ValidationError, where: Callable[[str], str], model: type[BaseModel], prefix: str = ""
) -> str:
    """One line for the first error: location (from `where`), dotted field, expectation.

    `prefix` is prepended to field paths when the validated model is a section of a
    larger config (e.g. ``hardware.``).
    """
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
    dotted = prefix + ".".join(loc) if loc else prefix.rstrip(".")
    expected = _expectation(first, model, loc)
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    field = f"{dotted}: " if dotted else ""
    return f"{where(dotted)}: {field}{expected}{more}"


def _expectation(error: dict, model: type[BaseModel], loc: list[str]) -> str:
    kind = error["type"]
    msg: str = error["msg"]
    if kind == "extra_forbidden":
        allowed = _fields_at(model, loc[:-1])
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        return f"unknown field {loc[-1]!r}{hint}"
    if kind == "missing":
        return "missing required field"
    if msg.startswith("Value error, "):
        text = msg.removeprefix("Value error, ")
    elif msg.startswith("Input should be "):
        text = "expected " + msg.removeprefix("Input should be ")
        if text.startswith(("expected greater", "expected less")):
            text = text.replace("expected ", "expected a value ", 1)
    else:
        text = msg[0].lower() + msg[1:]
    value = error.get("input")
    if is_secret(model, loc):
        return text  # a mistyped secret is still a secret
    if kind != "value_error" and not isinstance(value, (dict, list)) and value is not None:
        text += f", got {value!r}"
    return text


def is_secret(model: type[BaseModel], loc: list[str]) -> bool:
    """Whether the field at `loc` holds a `SecretStr` (its value is never echoed)."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or part.isdigit():
            continue
        info = current.model_fields.get(part)
        if info is None:
            return False
        if SecretStr in (info.annotation, *typing.get_args(info.annotation)):
            return True
        current = _model_in(info.annotation)
    return False


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or part.isdigit():
            continue
        info = current.model_fields.get(part)
        current = _model_in(info.annotation) if info else None
    return sorted(current.model_fields) if current else []


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, dict):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None
