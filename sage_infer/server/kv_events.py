"""``GET /v1/kv/events/stream``: this instance's KV block events, pushed to a fleet router as they happen.

One long-lived response of newline-delimited JSON objects, each a line:

- ``{"type": "snapshot", "next": N, "blocks": {"device": [hash16, ...], "host": [...], ...}, "recipe": {...}}``
  first, and again whenever the reader fell behind the bounded log: replace everything known of this instance;
  ``recipe`` says how it names blocks (``block_size``, ``model_id``, ``revision``, ``kv_dtype``, ``layout``: with
  a request's ``cache_salt``, the extra key of `prefix_reuse.hashing`), so a router hashes token-id prompts itself;
  for a model with KV groups (sliding-window layers) also ``kv_groups``: per group its ``kind``
  (``full_attention`` / ``sliding_window``) and ``sliding_window``;
- ``{"type": "events", "next": N, "events": [["stored" | "removed", medium, key], ...]}`` in order;
- ``{"type": "load", "num_running": r, "num_waiting": w, "kv_usage": u}`` every `HEARTBEAT_S`: the
  router's heartbeat (a replica silent for a few of them is out of the routing) and its queue.

A block's key is the first 8 bytes of its chained prefix hash in hex (``hash16``); with KV groups, a block of group
``g`` ≥ 1 is ``hash16@g`` (the same hash in every group: a router hashes a prompt once and asks each group for the
blocks a hit needs there, `kv_policy.group_hit`).

The stream ends when the server shuts down; a router reconnects and gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

HEARTBEAT_S = 0.5
CHECK_S = 0.01  # how often the stream looks for new events in the engine's log (an in-process read)


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def event_stream(backend, closing: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The NDJSON lines of one reader, from a snapshot on; ends when `closing()` turns true."""
    cursor = -1
    last_beat = 0.0
    while not closing():
        read = backend.kv_events_read(cursor)
        if read.reset:
            yield _line({"type": "snapshot", "next": read.next, "blocks": read.snapshot, "recipe": backend.kv_recipe()})
        elif read.events:
            yield _line({"type": "events", "next": read.next, "events": [e[:3] for e in read.events]})
        cursor = read.next
        now = time.monotonic()
        if now - last_beat >= HEARTBEAT_S:
            last_beat = now
            stats = backend.stats()
            yield _line({"type": "load", "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                         "kv_usage": stats.kv_usage})
        await asyncio.sleep(CHECK_S)
