"""A vLLM server's KV events, read by the fleet router: `sage llm router --replica URL,events=tcp://...`.

vLLM publishes its KV cache events on ZMQ when started with ``--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``: a PUB socket
sending ``[topic, seq, payload]`` (`seq` an 8-byte big-endian counter, `payload` a msgpack ``KVEventBatch``
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), and a ROUTER socket that answers a start sequence number (8 bytes,
big-endian) with every batch it kept from there on, as ``[topic, seq, payload]``, then ``[b"", -1, b""]``.

vLLM names a block by its own hash (sha256 of CBOR, or Python's hash, seeded), which the router cannot compute
from a prompt without vLLM's code. But every ``BlockStored`` carries the block's token ids and its parent's hash,
so the router renames each block as it arrives (`BlockNames`): sage's chained hash (`prefix_reuse.hashing`) of
the parent's new name and the block's tokens, under an extra key of its own (`vllm_extra_key`, with the cache
salt vLLM reports on a salted prompt's first block). A request's prompt, tokenized by a vLLM replica
(``POST /tokenize``) or given as token ids, is hashed the same way, so the fleet index matches it against those
blocks. A hybrid model's events name their KV cache group (``group_idx``; a stored block also its group's
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``): a group's block is keyed as a sage replica's are
(`kv_policy.group_hit.group_key`), and the replica's hit needs each group's blocks as `BlockNames.group_needs` says
(every block of a full-attention group, the window's of a sliding one). Blocks stored under a LoRA adapter,
multimodal inputs or prompt embeddings keep no name here (a request with them is routed by load); so do blocks
whose parent the router never saw.

`VllmEventFeed` subscribes, asks the replay socket for every batch still kept (vLLM sends no snapshot: what the
replay no longer holds stays unknown until stored again), then follows the live batches in order, asking again
for any it missed. Decoding uses msgspec structs laid out as vLLM 0.32's; vLLM itself is not imported.
"""

# no `from __future__ import annotations`: msgspec reads the annotations of the structs `batch_decoder` defines
import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sage_infer.errors import NotAvailableError, UsageError
from sage_infer.kv_policy.group_hit import SLIDING_WINDOW, group_key, window_needs
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import hash_block, make_extra_key, prompt_block_hashes

log = logging.getLogger("sage_infer.router")
MEDIA = {"GPU": "device", None: "device", "CPU": "host", "STORAGE": "disk", "DISK": "disk", "REMOTE": "remote"}
MAX_NAMES = 1 << 20  # vLLM hashes the router keeps a name for (oldest forgotten first)
REPLAY_TIMEOUT_S = 2.0
END_SEQ = -1
MAX_RANKS = 256  # data-parallel ranks one --replica may name
CLEARED = "cleared"  # the op of an AllBlocksCleared: the replica holds nothing now
NAMING = "vllm/{block_size}"  # `Replica.naming` of a vLLM replica with blocks of that many tokens
Op = tuple[str, str, str]  # (stored | removed | cleared, medium, short name)


def events_missing() -> str | None:
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as err:
        return f"reading vLLM's KV events needs pyzmq and msgspec (pip install 'sage-infer[events]'): {err}"
    return None


@functools.cache
def vllm_extra_key(cache_salt: str | None = None) -> bytes:
    """The extra key under which the router names a vLLM replica's blocks (and hashes prompts for them)."""
    return make_extra_key("vllm", "", "", "", cache_salt or None)


def prompt_names(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[str]:
    """A prompt's blocks as `BlockNames` names a vLLM replica's: every full block before its last token."""
    return [short(h) for h in prompt_block_hashes(token_ids, block_size, vllm_extra_key(cache_salt))]


@dataclass(frozen=True, slots=True)
class VllmEndpoints:
    """Where a vLLM replica publishes its KV events (its ``--kv-events-config``, with the host filled in)."""

    events: str  # the PUB socket, e.g. tcp://10.0.0.5:5557
    replay: str | None = None  # the ROUTER socket that resends kept batches
    topic: str = ""
    ranks: int = 1  # data-parallel ranks behind the server's URL (its --data-parallel-size)
    rank: int | None = None  # the one rank these endpoints are (`of_rank`); None without data parallelism

    def of_rank(self, rank: int) -> "VllmEndpoints":
        """Where rank `rank` of a data-parallel server publishes: vLLM offsets both endpoints' ports by the rank (an
        ipc path gets a ``_dp<rank>`` suffix)."""
        replay = offset_endpoint(self.replay, rank) if self.replay is not None else None
        return dataclasses.replace(self, events=offset_endpoint(self.events, rank), replay=replay, ranks=1,
                                   rank=rank)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's endpoint of a data-parallel rank: tcp://HOST:PORT -> tcp://HOST:PORT+rank, ipc://PATH -> PATH_dp<rank>
    (rank 0 keeps the endpoint as given)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def parse_replica(value: str) -> tuple[str, VllmEndpoints | None]:
    """``URL`` or ``URL,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T][,dp=N]`` -> (URL, endpoints);
    UsageError naming the value otherwise. ``dp=N``: the server runs N data-parallel ranks (vLLM's
    ``--data-parallel-size``), rank r publishing on the ports + r."""
    url, *options = value.split(",")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--replica {value}: expected an http(s) URL, e.g. http://127.0.0.1:8100")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, setting = option.partition("=")
        if not sep or key not in ("events", "replay", "topic", "dp") or key in fields:
            raise UsageError(f"--replica {value}: {option!r}: expected events=, replay=, topic= or dp=, each once "
                             "(URL,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T][,dp=N])")
        fields[key] = setting
    if not fields:
        return url, None
    ranks = fields.pop("dp", "1")
    if not ranks.isdigit() or not 1 <= int(ranks) <= MAX_RANKS:
        raise UsageError(f"--replica {value}: dp={ranks}: expected the server's data-parallel size, 1 to {MAX_RANKS}")
    for key in ("events", "replay"):
        endpoint = fields.get(key)
        if endpoint is not None and (not endpoint.startswith(("tcp://", "ipc://")) or "*" in endpoint
                                     or endpoint.startswith("tcp://") and not endpoint.rpartition(":")[2].isdigit()):
            raise UsageError(f"--replica {value}: {key}={endpoint}: expected a ZMQ address to connect to, "
                             "tcp://HOST:PORT or ipc://PATH")
    if "events" not in fields:
        raise UsageError(f"--replica {value}: replay=, topic= and dp= need events=tcp://HOST:PORT")
    endpoints = VllmEndpoints(fields["events"], fields.get("replay"), fields.get("topic", ""), int(ranks))
    rank_ports = [offset_endpoint(e, r) for e in (endpoints.events, endpoints.replay) if e for r in range(int(ranks))]
    if len(set(rank_ports)) != len(rank_ports):
        raise UsageError(f"--replica {value}: with dp={ranks} the ranks' events and replay ports (each + rank) "
                         "overlap: space events= and replay= at least dp ports apart")
    return url, endpoints


@functools.cache
def batch_decoder():
    """A msgspec decoder of vLLM 0.32's ``KVEventBatch`` (unknown fields ignored, later ones optional)."""
    import msgspec

    class Event(msgspec.Struct, tag=True, omit_defaults=True):
        pass

    class BlockStored(Event, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None = None
        medium: str | None = None
        lora_name: str | None = None
        extra_keys: list[list[Any] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(Event, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None = None
        group_idx: int | None = None

    class AllBlocksCleared(Event, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return msgspec.msgpack.Decoder(KVEventBatch)


class BlockNames:
    """vLLM block hash -> the router's name for the block (sage's chained hash of its tokens) and its extra key."""

    def __init__(self, limit: int = MAX_NAMES) -> None:
        self.names: OrderedDict[bytes | int, tuple[bytes, bytes]] = OrderedDict()
        self.limit = limit
        self.block_size = 0  # tokens per block, from the first BlockStored
        self.groups: dict[int, dict] = {}  # KV cache group -> its kind and window, as its BlockStored events say

    def translate(self, events: Sequence[Any]) -> list[Op]:
        """One decoded batch's events as the fleet index's ops, in order; events it cannot name are left out."""
        ops: list[Op] = []
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                ops.append((CLEARED, "", ""))
                continue
            if event.medium not in MEDIA:
                continue  # a medium the index has no tier for
            medium, group = MEDIA[event.medium], getattr(event, "group_idx", None) or 0
            if kind == "BlockStored":
                if getattr(event, "kv_cache_spec_kind", None) is not None:
                    self.groups[group] = {"kind": event.kv_cache_spec_kind,
                                          "sliding_window": event.kv_cache_spec_sliding_window}
                ops += [("stored", medium, group_key(name, group)) for name in self.stored(event)]
            else:
                ops += [("removed", medium, group_key(short(self.names[h][0]), group)) for h in event.block_hashes
                        if h in self.names]
        return ops

    def group_needs(self) -> tuple[int, ...]:
        """Per KV cache group the blocks a prefix hit needs (`kv_policy.group_hit`); () while every group it has seen
        attends fully (one block table's hit: the leading blocks)."""
        if not self.block_size or all(g.get("kind") != SLIDING_WINDOW for g in self.groups.values()):
            return ()
        return window_needs([self.groups.get(g, {}) for g in range(max(self.groups) + 1)], self.block_size)

    def stored(self, event) -> list[str]:
        """Name the blocks of one BlockStored, each chained on the one before (the first on its parent). A sliding
        window group's event carries the tokens of every new full block but the hashes of only those it keeps, the
        last ones (vLLM skips the blocks before the window): the chain runs over all of them."""
        size, count = event.block_size, len(event.block_hashes)
        total = len(event.token_ids) // size if size > 0 else 0
        if event.lora_id is not None or event.lora_name or count == 0 or len(event.token_ids) != total * size \
                or total < count:
            return []
        if self.block_size and size != self.block_size:
            return []
        parent, key = None, vllm_extra_key()
        if event.parent_block_hash is not None:
            if event.parent_block_hash not in self.names:
                return []
            parent, key = self.names[event.parent_block_hash]
        extra = event.extra_keys or [None] * count
        if len(extra) != count:
            return []
        skip = total - count  # leading blocks of the tokens the event stores no hash for
        names = []
        for i in range(total):
            extra_key = extra[i - skip] if i >= skip else None
            if extra_key is not None:  # a salted first block names its chain; anything else is not the router's
                if parent is not None or len(extra_key) != 1 or not isinstance(extra_key[0], str):
                    break
                key = vllm_extra_key(extra_key[0])
            parent = hash_block(parent, event.token_ids[i * size:(i + 1) * size], key)
            if i >= skip:
                self._keep(event.block_hashes[i - skip], parent, key)
                names.append(short(parent))
        self.block_size = size
        return names

    def _keep(self, vllm_hash: bytes | int, name: bytes, key: bytes) -> None:
        self.names[vllm_hash] = (name, key)
        self.names.move_to_end(vllm_hash)
        if len(self.names) > self.limit:
            self.names.popitem(last=False)


class VllmEventFeed:
    """Follows one vLLM server's ZMQ KV events; `run` calls `apply` with each batch's ops, in sequence order."""

    def __init__(self, endpoints: VllmEndpoints) -> None:
        why = events_missing()
        if why is not None:
            raise NotAvailableError(why)
        self.endpoints = endpoints
        self.names = BlockNames()
        self.last = -1  # the last sequence number applied

    async def run(self, apply: Callable[[list[Op]], None]) -> None:
        """Subscribe, replay what the server kept, then follow it until cancelled."""
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        try:
            sub.connect(self.endpoints.events)
            sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
            await self.replay(context, apply)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq > self.last + 1:  # batches lost between the server and here: ask for them
                    await self.replay(context, apply)
                if seq > self.last:
                    self.take(seq, frames[2], apply)
        finally:
            context.destroy(linger=0)

    async def replay(self, context, apply: Callable[[list[Op]], None]) -> None:
        """Every batch the server kept after the last applied one (nothing without a replay endpoint)."""
        import zmq

        if self.endpoints.replay is None:
            return
        dealer = context.socket(zmq.DEALER)
        try:
            dealer.connect(self.endpoints.replay)
            await dealer.send_multipart((b"", (self.last + 1).to_bytes(8, "big")))
            while await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                frames = await dealer.recv_multipart()  # [b"", topic, seq, payload]
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq > self.last:
                    self.take(seq, frames[-1], apply)
            log.warning("vLLM replay socket %s did not answer in %.0f s", self.endpoints.replay, REPLAY_TIMEOUT_S)
        finally:
            dealer.close(linger=0)

    def take(self, seq: int, payload: bytes, apply: Callable[[list[Op]], None]) -> None:
        import msgspec

        self.last = seq
        try:
            batch = batch_decoder().decode(payload)
        except msgspec.DecodeError as err:  # one batch lost: its blocks are missed, not misnamed
            log.warning("vLLM KV event batch %d from %s not decoded: %s", seq, self.endpoints.events, err)
            return
        apply(self.names.translate(batch.events))
