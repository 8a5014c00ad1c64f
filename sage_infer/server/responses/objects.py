"""The Responses API's objects as OpenAI defines them (`openai.types.responses`): the response, its output message
item, its usage. Plain dicts, built in one place for the plain and the streamed answer."""

from __future__ import annotations

import uuid

from sage_infer.core.outputs import RequestOutput
from sage_infer.server.responses.protocol import ResponsesRequest


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An assistant message output item; `text` None: not started yet (no content part)."""
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(call: dict, status: str = "completed") -> dict:
    """A chat ``tool_calls`` entry as a Responses ``function_call`` item."""
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def tool_calls_of(items: list[dict]) -> list[dict]:
    """The ``function_call`` items among `items` as a chat message's ``tool_calls``."""
    return [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
            for item in items if item["type"] == "function_call"]


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_items(message: dict, status: str) -> list[dict]:
    """A finished answer (a chat message: content, tool_calls, reasoning_content) as output items: its reasoning,
    its text (left out when it is empty and the answer called tools), its function calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "", status))
    items.extend(function_call_item(call, status) for call in calls)
    return items


def output_text_of(items: list[dict]) -> str:
    return "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(final: RequestOutput) -> dict:
    prompt = len(final.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in final.outputs)
    cached = final.metrics.num_cached_tokens
    # the prompt tokens computed here were written to the KV cache (in full blocks, for later prefix hits)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached,
                                                             "cache_write_tokens": prompt - cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def status_of(final: RequestOutput) -> tuple[str, dict | None]:
    """(status, incomplete_details): a completion cut by its token limit is incomplete."""
    if final.outputs and final.outputs[0].finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(response_id: str, created_at: int, body: ResponsesRequest, model: str, *, status: str,
                    output: list[dict], usage: dict | None = None, incomplete: dict | None = None,
                    stored: bool = False) -> dict:
    """The response object (``object: "response"``)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": None, "store": stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": body.text.format.model_dump(by_alias=True) if body.text and body.text.format
                 else {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
        "usage": usage, "user": body.user, "metadata": body.metadata or {},
    }
