"""Request bodies from raw bytes to validated pydantic models, or an OpenAI-style 400.

JSON nesting is checked on the raw bytes before anything parses them: `json.loads` and
pydantic recurse once per level, so a body nested thousands deep would otherwise end
in a RecursionError (a 500) or a crashed worker instead of a clear 400.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from sage_infer.server.openai_errors import APIError

# deep enough for any real request (tool schemas nest a few dozen levels at most)
MAX_JSON_DEPTH = 64

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # brackets inside strings do not nest
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_OPEN_IS_2_CLOSE_IS_0 = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")

Model = TypeVar("Model", bound=BaseModel)
# a \uD800-\uDFFF escape: only then can a parsed string hold a lone surrogate (raw UTF-8 cannot encode one)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(value: object, path: str = "") -> str | None:
    """The dotted path of the first string in `value` that is not encodable text (an unpaired surrogate), if any;
    the body's root is named ``body``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := lone_surrogate(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays/objects in a JSON text, found without parsing it.

    Strings are blanked first, then every bracket becomes +1 or -1 and the running sum's
    maximum is the depth; all of it runs in C (a few hundred ms for 4 MB of brackets).
    Malformed JSON gives some number; the parser rejects it afterwards anyway.
    """
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b'""', raw)).translate(_OPEN_IS_2_CLOSE_IS_0)
    # depth after the i-th bracket = sum of (value - 1) = running sum of values - i
    return max(map(operator.sub, itertools.accumulate(brackets), itertools.count(1)), default=0)


def parse_body(raw: bytes, schema: type[Model]) -> Model:
    """Parse and validate one request body; every failure is an `APIError` 400."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(400, f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"request body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") \
            from None
    except RecursionError:  # belt and braces: the depth scan should have caught it
        raise APIError(400, "request body is nested too deeply") from None
    except ValueError as err:  # an integer past Python's 4,300-digit conversion limit
        raise APIError(400, f"request body has a number that cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and (where := lone_surrogate(data)) is not None:
        raise APIError(400, f"{where}: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                       where)
    return validate_body(data, schema)


def validate_body(data: dict, schema: type[Model]) -> Model:
    """`data` (a parsed JSON object) as `schema`; a failure is an `APIError` 400 naming the first bad field."""
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{field}: {message}" if field else message, field) from None
