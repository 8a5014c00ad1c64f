"""`ResponseEvents`: a streamed response's server-sent events, as OpenAI defines them.

In order: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per new text), ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; then each function call the answer made (and its
reasoning, with a reasoning parser) as a whole item (``response.output_item.added``,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``); then ``response.completed``
(or ``response.incomplete`` when the token limit cut it). A failure after the status line is an ``error`` event.
Every event carries its ``sequence_number`` and is sent with its ``event:`` name.
"""

from __future__ import annotations

import json

from sage_infer.server.responses.objects import output_text


class ResponseEvents:
    """Numbers and formats one stream's events (one output message, one text part)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def created(self, response: dict) -> str:
        return self._event("response.created", response=response)

    def in_progress(self, response: dict) -> str:
        return self._event("response.in_progress", response=response)

    def item_added(self, index: int, item: dict) -> str:
        return self._event("response.output_item.added", output_index=index, item=item)

    def part_added(self, item_id: str) -> str:
        return self._event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                           part=output_text(""))

    def text_delta(self, item_id: str, delta: str) -> str:
        return self._event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                           delta=delta, logprobs=[])

    def text_done(self, item_id: str, text: str) -> str:
        return self._event("response.output_text.done", item_id=item_id, output_index=0, content_index=0,
                           text=text, logprobs=[])

    def part_done(self, item_id: str, part: dict) -> str:
        return self._event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                           part=part)

    def item_done(self, index: int, item: dict) -> str:
        return self._event("response.output_item.done", output_index=index, item=item)

    def arguments_delta(self, item_id: str, index: int, delta: str) -> str:
        return self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                           delta=delta)

    def arguments_done(self, item_id: str, index: int, arguments: str) -> str:
        return self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                           arguments=arguments)

    def finished(self, response: dict) -> str:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def error(self, error: dict) -> str:
        return self._event("error", code=str(error.get("code")), message=error["message"], param=error.get("param"))
