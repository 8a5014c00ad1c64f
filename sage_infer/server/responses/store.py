"""`ResponseStore`: the responses the server keeps (``store: true``), per tenant, bounded, optionally on disk.

A stored response keeps its object (what ``GET /v1/responses/{id}`` returns), the conversation through its output
as chat messages (what ``previous_response_id`` continues) and its input items (``.../input_items``). It lives until
its TTL passes, it is deleted, or the store is past `max_stored` responses or `max_bytes` of JSON (the oldest go
first); `on_drop` hears every id that leaves, so the KV retained for it is released too. A response is found only
under the tenant that created it: another tenant's id and an unknown one look the same.

With a `directory` (the disk KV tier's), every stored response is also one JSON file there, written atomically and
read back at the next start, so conversations survive a restart along with their KV blocks. JSON only, never pickle.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("sage_infer.server")

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


@dataclass(slots=True)
class StoredResponse:
    id: str
    tenant: str  # hex digest of the tenant's key and salt (`tenant_of`), never the salt itself
    created_at: float  # wall-clock seconds
    expires_at: float
    messages: list[dict]  # the conversation through this response's output (instructions not included)
    response: dict  # the response object
    input_items: list[dict] = field(default_factory=list)  # what `GET /v1/responses/{id}/input_items` lists

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))


class ResponseStore:
    """Stored responses by id, oldest first; bounded by count, bytes and TTL."""

    def __init__(self, ttl_s: float, max_stored: int, max_bytes: int, directory: str | Path | None = None,
                 on_drop: Callable[[str], None] = lambda _: None, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.max_stored = max_stored
        self.max_bytes = max_bytes
        self.directory = Path(directory) if directory is not None else None
        self.on_drop = on_drop
        self.clock = clock
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()  # id -> (response, JSON bytes)
        self.num_bytes = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The stored response, or None when unknown, expired or another tenant's."""
        self.expire()
        found = self._items.get(response_id)
        if found is not None and found[0].expires_at <= self.clock():  # a TTL cut short by a restart's new setting
            self._drop(response_id)
            return None
        return found[0] if found is not None and found[0].tenant == tenant else None

    def put(self, stored: StoredResponse) -> bool:
        """Keep `stored` (dropping the oldest past the bounds); False when it alone is past `max_bytes` (then it
        is not kept)."""
        self.expire()
        text = stored.to_json()
        size = len(text.encode("utf-8"))
        if self.max_stored == 0 or size > self.max_bytes:
            return False
        while self._items and (len(self._items) >= self.max_stored or self.num_bytes + size > self.max_bytes):
            self._drop(next(iter(self._items)))
        self._items[stored.id] = (stored, size)
        self.num_bytes += size
        if self.directory is not None:
            self._write(stored.id, text)
        return True

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response of `tenant`; False when it has none by that id."""
        if self.get(tenant, response_id) is None:
            return False
        self._drop(response_id)
        return True

    def expire(self) -> int:
        """Drop every response past its TTL (oldest first, so the scan stops at the first live one)."""
        now, expired = self.clock(), []
        for response_id, (stored, _) in self._items.items():
            if stored.expires_at > now:
                break
            expired.append(response_id)
        for response_id in expired:
            self._drop(response_id)
        return len(expired)

    def _drop(self, response_id: str) -> None:
        _, size = self._items.pop(response_id)
        self.num_bytes -= size
        if self.directory is not None:
            (self.directory / f"{response_id}.json").unlink(missing_ok=True)
        self.on_drop(response_id)

    def _write(self, response_id: str, text: str) -> None:
        path = self.directory / f"{response_id}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except OSError as err:  # the response is still served from memory; only a restart loses it
            log.warning("could not write stored response %s to %s: %s", response_id, self.directory, err)

    def _load(self) -> None:
        """Read the responses a previous run stored, oldest first; drop the expired and the unreadable."""
        found: list[StoredResponse] = []
        for path in self.directory.glob("resp_*.json"):
            if not RESPONSE_ID.match(path.stem):
                continue
            try:
                found.append(StoredResponse(**json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError) as err:
                log.warning("ignoring unreadable stored response %s: %s", path, err)
                path.unlink(missing_ok=True)
        now = self.clock()
        for stored in sorted(found, key=lambda s: s.created_at):
            if stored.expires_at <= now or not self.put(stored):
                (self.directory / f"{stored.id}.json").unlink(missing_ok=True)
