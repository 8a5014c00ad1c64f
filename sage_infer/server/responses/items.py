"""A response's input items (``GET /v1/responses/{id}/input_items``): what the model was given, as item objects.

A response's input items are the items of the conversation it continued (the previous response's input items and
its output items, in order) followed by the request's own ``input``, each with an id; ``instructions`` are not an
item. They are listed a page at a time as OpenAI lists them: ``order`` (``desc``, newest first, by default),
``limit`` (1 to 100, 20 by default), and the ``after`` / ``before`` cursors, each an item id of this response.
"""

from __future__ import annotations

import uuid

from sage_infer.server.openai_errors import APIError
from sage_infer.server.responses.objects import output_text
from sage_infer.server.responses.protocol import FunctionCallItem, MessageItem, ReasoningItem

MAX_LIMIT = 100
DEFAULT_LIMIT = 20


def item_objects(items: list) -> list[dict]:
    """A request's typed input items (`protocol.input_items`) as OpenAI's item objects, each with a new id."""
    objects = []
    for item in items:
        if isinstance(item, MessageItem):
            parts = ([{"type": "input_text", "text": item.content}] if isinstance(item.content, str)
                     else [part.model_dump() for part in item.content])
            if item.role == "assistant":  # an earlier answer given back: an output message
                parts = [output_text(part["text"]) for part in parts]
            objects.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": item.role,
                            "content": parts, "status": "completed"})
        elif isinstance(item, ReasoningItem):
            objects.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                            "summary": [part.model_dump() for part in item.summary],
                            "content": [part.model_dump() for part in item.content or []], "status": "completed"})
        elif isinstance(item, FunctionCallItem):
            objects.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": item.call_id,
                            "name": item.name, "arguments": item.arguments, "status": "completed"})
        else:
            objects.append({"id": f"fco_{uuid.uuid4().hex}", "type": "function_call_output",
                            "call_id": item.call_id, "output": item.output, "status": "completed"})
    return objects


def _position(items: list[dict], item_id: str, param: str) -> int:
    for i, item in enumerate(items):
        if item.get("id") == item_id:
            return i
    raise APIError(400, f"{param}: no input item with id '{item_id[:128]}' in this response", param)


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit: an integer from 1 to {MAX_LIMIT}", "limit")
    return limit


def item_page(items: list[dict], query: dict[str, str]) -> dict:
    """One page of `items` as OpenAI's list object, by the query's ``order``, ``limit``, ``after``, ``before``."""
    if "include" in query or "include[]" in query:
        raise APIError(400, "include: no additional item data is available from this server", "include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order: 'asc' or 'desc'", "order")
    limit = _limit(query.get("limit"))
    ordered = list(items) if order == "asc" else list(reversed(items))
    end = len(ordered) if query.get("before") is None else _position(ordered, query["before"], "before")
    start = 0 if query.get("after") is None else _position(ordered, query["after"], "after") + 1
    window = ordered[start:end]
    if query.get("before") is not None and query.get("after") is None:  # the page just before the cursor
        page = window[-limit:]
    else:
        page = window[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(window) > len(page)}
