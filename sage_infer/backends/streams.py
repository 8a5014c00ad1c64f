"""The per-request output stream every backend hands the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sage_infer.core.outputs import RequestOutput


async def stream_outputs(outputs: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs from `outputs` until the finished one (an exception put there is raised);
    `abort` it if the consumer stops before that."""
    finished = False
    try:
        while not finished:
            item = await outputs.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
