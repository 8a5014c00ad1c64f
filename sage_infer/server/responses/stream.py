"""`ResponseEvents`: a streamed response's server-sent events, as OpenAI defines them.

In order: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per new text), ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``. Each function call the answer makes is its own item,
sent as it is written (`CallItems`): ``response.output_item.added`` once its name is known, then a
``response.function_call_arguments.delta`` per piece of its arguments, and ``.done`` / ``response.output_item.done``
when the answer ends; a reasoning parser's section follows as a whole item. Then ``response.completed`` (or
``response.incomplete`` when the token limit cut it). A failure after the status line is an ``error`` event.
Every event carries its ``sequence_number`` and is sent with its ``event:`` name.
"""

from __future__ import annotations

import json
import uuid

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


class CallItems:
    """A streamed answer's function calls as items, sent as they are written: the chat stream's ``tool_calls``
    pieces (by index: the first has the call's id and name, later ones pieces of its arguments) become
    ``function_call`` items after the message item (output index 1, 2, ...)."""

    def __init__(self, events: ResponseEvents) -> None:
        self.events = events
        self.items: list[dict] = []
        self._by_index: dict[int, dict] = {}

    def feed(self, pieces: list[dict]) -> list[str]:
        sent = []
        for piece in pieces:
            function = piece.get("function") or {}
            item = self._by_index.get(piece.get("index", 0))
            if item is None:
                item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": piece.get("id") or "",
                        "name": function.get("name") or "", "arguments": "", "status": "in_progress"}
                self._by_index[piece.get("index", 0)] = item
                self.items.append(item)
                sent.append(self.events.item_added(len(self.items), dict(item)))
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                sent.append(self.events.arguments_delta(item["id"], self.items.index(item) + 1,
                                                        function["arguments"]))
        return sent

    def done(self, status: str) -> list[str]:
        """Each call's arguments whole and its item done (with the answer's status)."""
        sent = []
        for index, item in enumerate(self.items, start=1):
            item["status"] = status
            sent += [self.events.arguments_done(item["id"], index, item["arguments"]),
                     self.events.item_done(index, item)]
        return sent
