"""OpenAI's Responses API (`/v1/responses`) with responses the server keeps: protocol, store, handlers, events."""
