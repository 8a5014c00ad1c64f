"""Incremental parser for ``text/event-stream`` bodies (the OpenAI streaming format)."""

from __future__ import annotations


class SSEDecoder:
    """Incremental ``text/event-stream`` parser: feed bytes as they arrive, get each event's data.

    Lines may be split anywhere across chunks (even inside a UTF-8 character); an event
    ends at a blank line. Only ``data:`` fields matter to OpenAI streams.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        return self.feed(b"\n\n") if self._buffer or self._data else []
