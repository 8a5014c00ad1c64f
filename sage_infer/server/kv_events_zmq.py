"""KV block events in vLLM's ZMQ format (`kv_events.publisher: zmq`), for routers built for vLLM.

llm-d's precise prefix-cache scorer and Dynamo's KV router subscribe to vLLM's event stream: a
ZMQ PUB socket sending ``[topic, seq, payload]`` — `seq` an 8-byte big-endian counter, `payload`
a msgpack ``KVEventBatch`` as vLLM 0.32 encodes it (msgspec): an array ``[ts, events]`` whose
events are maps tagged by ``"type"``:

- ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``;
- ``BlockRemoved``: ``block_hashes``, ``medium``;
- ``AllBlocksCleared``.

A replica publishes its own log (`prefix_reuse.events`) in that shape: block hashes are the first
8 bytes of sage's chained hashes, the device's stored blocks carry their parent and token ids
(lower tiers' placements carry none), and the medium is vLLM's name for the tier (``GPU`` for the
device pool, ``CPU`` host, ``DISK``, ``REMOTE``). A model with KV groups (sliding-window layers) tags every event
with its group as vLLM does for its KV cache groups: ``group_idx`` on both, and on ``BlockStored`` the group's
``kv_cache_spec_kind`` (``full_attention`` / ``sliding_window``) and ``kv_cache_spec_sliding_window``; a block's
hash is its chained prefix hash in every group (the group tells them apart). A ROUTER socket (``replay_endpoint``)
answers a subscriber that missed batches, as vLLM's does: it sends the start sequence number (8 bytes, big-endian)
and gets every kept batch from there as ``[topic, seq, payload]``, then ``[b"", -1, b""]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from sage_infer.errors import ConfigError, NotAvailableError

log = logging.getLogger("sage_infer.server")
MEDIUM = {"device": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}  # vLLM's names for the tiers
POLL_S = 0.01  # how often the publisher looks for new events in the engine's log
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def zmq_missing() -> str | None:
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as err:
        return f"the ZMQ event publisher needs pyzmq and msgspec (pip install 'sage-infer[events]'): {err}"
    return None


def _hash(key: str) -> bytes:
    """The 8 hash bytes of a logged block key (``hash16``, or ``hash16@group`` for a KV group's block)."""
    return bytes.fromhex(key.partition("@")[0])


def _group_of(key: str) -> int:
    return int(key.partition("@")[2] or 0)


def _stored(key: str, parent: str | None, token_ids: tuple[int, ...], block_size: int, medium: str,
            group: int | None = None, spec: dict | None = None) -> dict:
    event = {"type": "BlockStored", "block_hashes": [_hash(key)],
             "parent_block_hash": None if parent is None else bytes.fromhex(parent), "token_ids": list(token_ids),
             "block_size": block_size, "lora_id": None, "medium": MEDIUM.get(medium, medium.upper()),
             "lora_name": None}
    if group is not None:  # a model with KV groups: vLLM's per-group fields
        spec = spec or {}
        event.update(group_idx=group, kv_cache_spec_kind=spec.get("kind"),
                     kv_cache_spec_sliding_window=spec.get("sliding_window"))
    return event


def _removed(key: str, medium: str, group: int | None = None) -> dict:
    event = {"type": "BlockRemoved", "block_hashes": [_hash(key)], "medium": MEDIUM.get(medium, medium.upper())}
    if group is not None:
        event["group_idx"] = group
    return event


class ZmqEventPublisher:
    """Publishes `backend`'s KV events on `config.endpoint` from a thread of its own until `close`."""

    def __init__(self, backend, config) -> None:
        why = zmq_missing()
        if why is not None:
            raise NotAvailableError(f"kv_events.publisher zmq: {why}")
        if backend.kv_events_read(-1) is None:
            raise ConfigError("kv_events.publisher zmq: this instance logs no KV events (prefix caching off, or a "
                              "decode worker)")
        import msgspec
        import zmq

        self.backend = backend
        recipe = backend.kv_recipe() or {}
        self.block_size = int(recipe.get("block_size", 0))
        self.groups = recipe.get("kv_groups")  # per KV group its kind and window (None: a model without groups)
        self.topic = config.topic.encode()
        self.encoder = msgspec.msgpack.Encoder()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.replay = None
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        try:
            self.pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = self.context.socket(zmq.ROUTER)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as err:
            self.context.destroy(linger=0)
            raise ConfigError(f"kv_events.endpoint: cannot bind {config.endpoint}: {err}") from None
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sage-kv-events-zmq", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cursor = -1
        while not self._stop.is_set():
            read = self.backend.kv_events_read(cursor)
            cursor = read.next
            events = self._events(read)
            if events:
                self._publish(events)
            if self.replay is not None:
                self._serve_replay()
            self._stop.wait(POLL_S)

    def _events(self, read) -> list[dict]:
        if read.reset:  # a fresh start (or a log overrun): everything held now, after a clear
            events = [{"type": "AllBlocksCleared"}]
            for medium, keys in read.snapshot.items():
                events += [self._stored(key, None, (), medium, _group_of(key) if self.groups else None)
                           for key in keys]
            return events if len(events) > 1 or self.seq else []
        return [self._stored(key, parent, tokens, medium, group) if op == "stored" else _removed(key, medium, group)
                for op, medium, key, parent, tokens, group in read.events]

    def _stored(self, key: str, parent: str | None, tokens: tuple[int, ...], medium: str, group: int | None) -> dict:
        spec = self.groups[group] if group is not None and self.groups and group < len(self.groups) else None
        return _stored(key, parent, tokens, self.block_size, medium, group, spec)

    def _publish(self, events: list[dict]) -> None:
        payload = self.encoder.encode([time.time(), events])  # KVEventBatch is array-like: [ts, events]
        seq = self.seq
        self.seq += 1
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except Exception as err:  # noqa: BLE001 - a send that fails loses this batch for live subscribers only
            log.warning("KV event batch %d not published: %s", seq, err)
        self.kept.append((seq, payload))

    def _serve_replay(self) -> None:
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.kept):
                if seq >= first:
                    self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.context.destroy(linger=0)
