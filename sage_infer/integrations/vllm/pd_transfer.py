"""Prefill/decode separation between two vLLM instances over sage's transport.

A proxy (``sage llm router``, or any proxy speaking vLLM's ``kv_transfer_params``) sends a
request first to the **producer** (``kv_role: kv_producer``) with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then the original request to the
**consumer** (``kv_role: kv_consumer``) with the ``kv_transfer_params`` the producer answered.

Producer. The scheduler-side connector plans, in each step's metadata, the copy of the
request's full prompt blocks computed by then (`PDPlanner`); after the forward the worker
copies them out of vLLM's cache into `HeldBlocks` (so vLLM frees its own blocks when the
request ends, as for any request), and the finished request answers
``{"do_remote_prefill": true, "sage_pd": {"address": "HOST:PORT", "transfer": ID, "num_blocks": N}}``.
The worker answers pulls on ``pd_host:pd_port`` (`PullServer`): one JSON line in, one out,
asking it to send blocks ``first .. first+count-1`` of a held transfer to a receiver's
transport address; it hands them to sage's `KVPipe`, which streams them as CRC32C-checked
chunks with their chained hashes as the manifest, and drops the hold.

Consumer. `get_num_new_matched_tokens` offers the held blocks past vLLM's own prefix-cache
hit as an *asynchronous* load (never the prompt's last token); once vLLM allocated blocks for
them, the worker registers where the rows land (`KVPipe.expect`), asks the producer to
send (`PullClient`, off the step), and, when they arrived, checks the sender's hashes against
the ones it computed for the prompt (model, dtype, layout, block size and ``cache_salt`` are
in them) before it copies the rows into vLLM's blocks. A pull that fails (producer gone, hold
expired, hashes differ, deadline passed) is reported as a failed receive: with
``kv_load_failure_policy="recompute"`` vLLM computes the prompt itself; never a wrong token.

The pull request names the producer's transfer and the receiver's address; with the
deployment's token (``SAGE_KV_TRANSPORT__AUTH_TOKEN``, at least 16 characters) it carries an
HMAC-SHA256 the producer checks, and the transport's own handshake makes both ends prove the
token, so blocks are never sent to a receiver without it. Without a token the pull port binds
loopback unless ``pd_host`` says otherwise. Nothing on this path is pickled.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from sage_infer.integrations.vllm.keys import KeySpace, extend_chain

log = logging.getLogger(__name__)
PARAMS_KEY = "sage_pd"  # our part of vLLM's kv_transfer_params
MAX_LINE = 4096  # a pull request or its answer
TOKEN_ENV = "SAGE_KV_TRANSPORT__AUTH_TOKEN"


# -- what travels in kv_transfer_params --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeldTransfer:
    """What a producer's answer tells the consumer: where to pull from and how many prompt blocks are held."""

    address: str  # HOST:PORT of the producer's pull server
    transfer: str
    num_blocks: int

    def params(self) -> dict:
        return {"do_remote_prefill": True,
                PARAMS_KEY: {"address": self.address, "transfer": self.transfer, "num_blocks": self.num_blocks}}

    @classmethod
    def of(cls, params: dict | None) -> HeldTransfer | None:
        """The held transfer a request's ``kv_transfer_params`` names; None when it names none (or a malformed one)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        held = params.get(PARAMS_KEY)
        try:
            address, transfer, num_blocks = held["address"], held["transfer"], held["num_blocks"]
        except (TypeError, KeyError):
            return None
        if not (isinstance(address, str) and isinstance(transfer, str) and isinstance(num_blocks, int)
                and 0 < len(transfer) <= 64 and num_blocks > 0):
            return None
        return cls(address, transfer, num_blocks)


# -- scheduler side: plain logic ------------------------------------------------------------------


@dataclass(slots=True)
class HoldIO:
    """Producer: blocks of one request to copy out for a consumer after this step's forward."""

    transfer: str
    block_ids: list[int]
    keys: list[bytes]


@dataclass(slots=True)
class PullIO:
    """Consumer: blocks ``first .. first+len(block_ids)-1`` of a held transfer, to land in `block_ids`."""

    req_id: str
    held: HeldTransfer
    first: int
    block_ids: list[int]
    keys: list[bytes]  # this instance's hashes of those blocks, which the sender's must equal


@dataclass(slots=True)
class _Hold:
    transfer: str
    extra_key: bytes
    prompt_tokens: int
    keys: list[bytes] = field(default_factory=list)
    num_held: int = 0


@dataclass(slots=True)
class _Pull:
    held: HeldTransfer
    keys: list[bytes]
    local_blocks: int  # vLLM's own prefix-cache hit, in blocks
    io: PullIO | None = None


class PDPlanner:
    """Which prompt blocks a producer holds each step, and which a consumer pulls."""

    def __init__(self, block_size: int, key_space: KeySpace, address: str | None = None) -> None:
        self.block_size = block_size
        self.key_space = key_space
        self.address = address  # the producer's pull server, HOST:PORT
        self._holds: dict[str, _Hold] = {}
        self._pulls: dict[str, _Pull] = {}
        self._in_flight: set[str] = set()  # consumer: pulls the worker has not reported finished

    # producer

    def hold(self, req_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None) -> None:
        if req_id not in self._holds:
            self._holds[req_id] = _Hold(uuid.uuid4().hex, self.key_space.extra_key(cache_salt), len(prompt_token_ids))

    def plan_holds(self, req_id: str, token_ids: Sequence[int], num_computed: int, block_ids: Sequence[int]
                   ) -> HoldIO | None:
        """The request's full prompt blocks computed by the end of this step and not copied out yet."""
        state = self._holds.get(req_id)
        if state is None:
            return None
        full = min(num_computed, state.prompt_tokens, len(block_ids) * self.block_size) // self.block_size
        if full <= state.num_held:
            return None
        extend_chain(state.keys, token_ids, full, self.block_size, state.extra_key)
        first, state.num_held = state.num_held, full
        return HoldIO(state.transfer, list(block_ids[first:full]), state.keys[first:full])

    def finished_hold(self, req_id: str) -> dict | None:
        """The ``kv_transfer_params`` a producer's finished request answers (None: it held nothing)."""
        state = self._holds.pop(req_id, None)
        if state is None:
            return None
        if state.num_held == 0:  # a prompt shorter than a block: the consumer computes it
            return {"do_remote_prefill": False}
        return HeldTransfer(self.address, state.transfer, state.num_held).params()

    # consumer

    def match(self, req_id: str, held: HeldTransfer, prompt_token_ids: Sequence[int], cache_salt: str | None,
              num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (block-aligned) to pull: whole held blocks, never the last token."""
        if req_id in self._in_flight:
            return 0
        bs = self.block_size
        num_blocks = min(held.num_blocks, max(len(prompt_token_ids) - 1, 0) // bs)
        local_blocks = num_computed_tokens // bs
        if num_blocks <= local_blocks:
            self._pulls.pop(req_id, None)
            return 0
        keys = extend_chain([], prompt_token_ids, num_blocks, bs, self.key_space.extra_key(cache_salt))
        self._pulls[req_id] = _Pull(held, keys, local_blocks)
        return (num_blocks - local_blocks) * bs

    def pulling(self, req_id: str) -> bool:
        """A pull was matched for the request and waits for vLLM's allocation."""
        return req_id in self._pulls

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        state = self._pulls.get(req_id)
        if state is None:
            return
        if num_external_tokens <= 0:
            del self._pulls[req_id]
            return
        first = state.local_blocks
        last = first + num_external_tokens // self.block_size
        assert last <= min(len(block_ids), len(state.keys)), "vLLM allocated more than was matched"
        state.io = PullIO(req_id, state.held, first, list(block_ids[first:last]), state.keys[first:last])

    def take_pulls(self) -> list[PullIO]:
        """The pulls allocated since the last step (each once)."""
        ready = [req_id for req_id, state in self._pulls.items() if state.io is not None]
        pulls = [self._pulls.pop(req_id).io for req_id in ready]
        self._in_flight.update(ready)
        return pulls

    def received(self, req_ids: Sequence[str]) -> None:
        """The worker reported these pulls finished (landed or failed)."""
        self._in_flight.difference_update(req_ids)

    def finished_pull(self, req_id: str) -> bool:
        """A consumer's request ended: True while its pull is in flight (vLLM keeps its blocks until it ends)."""
        self._pulls.pop(req_id, None)
        return req_id in self._in_flight


# -- producer worker ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    rows: list[torch.Tensor]
    keys: list[bytes]
    nbytes: int
    since: float


class HeldBlocks:
    """A producer's copies of prompt blocks by transfer, until a consumer pulls them or they expire.

    Bounded: past `max_bytes` the oldest transfer is dropped; a transfer older than `ttl_s`
    is dropped when the next one is added or taken. Thread-safe (the pull server's threads take).
    """

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.nbytes = 0
        self.dropped = 0  # transfers dropped unpulled (expired or pushed out)
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, transfer: str, rows: torch.Tensor, keys: Sequence[bytes]) -> None:
        with self._lock:
            entry = self._held.get(transfer)
            if entry is None:
                entry = self._held[transfer] = _Held([], [], 0, self.clock())
            entry.rows.append(rows)
            entry.keys.extend(keys)
            entry.nbytes += rows.numel()
            self.nbytes += rows.numel()
            self._trim(keep=transfer)

    def take(self, transfer: str, first: int, count: int) -> tuple[torch.Tensor, list[bytes]]:
        """Rows ``first .. first+count-1`` of `transfer` and their keys; the transfer is forgotten.
        KeyError (with the reason) when it is not held or holds fewer blocks."""
        with self._lock:
            self._trim()
            entry = self._held.pop(transfer, None)
            if entry is None:
                raise KeyError(f"transfer {transfer} is not held here (expired, pushed out or pulled already)")
            self.nbytes -= entry.nbytes
        if first < 0 or count <= 0 or first + count > len(entry.keys):
            raise KeyError(f"transfer {transfer} holds {len(entry.keys)} blocks, not {first}..{first + count - 1}")
        rows = entry.rows[0] if len(entry.rows) == 1 else torch.cat(entry.rows)
        return rows[first : first + count], entry.keys[first : first + count]

    def __len__(self) -> int:
        return len(self._held)

    def _trim(self, keep: str | None = None) -> None:
        now = self.clock()
        while self._held:
            transfer, entry = next(iter(self._held.items()))
            if transfer == keep or (now - entry.since < self.ttl_s and self.nbytes <= self.max_bytes):
                return
            self._held.popitem(last=False)
            self.nbytes -= entry.nbytes
            self.dropped += 1


def _sign(token: bytes, body: dict) -> str:
    return hmac.new(token, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


class PullServer:
    """The producer worker's pull port: ``{"transfer", "first", "count", "to", "id"[, "auth"]}`` in, then
    ``{"ok": true}`` once the send started, or ``{"error": ...}``. `send(id, to, rows, keys)` starts it."""

    def __init__(self, host: str, port: int, held: HeldBlocks,
                 send: Callable[[str, str, torch.Tensor, list[bytes]], None], token: bytes | None = None) -> None:
        self.held, self.send, self.token = held, send, token
        self.pulls = 0
        self.refused = 0
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.connection.settimeout(5.0)
                try:
                    line = self.rfile.readline(MAX_LINE)
                    reply = owner._answer(line)
                except (OSError, ValueError) as err:
                    reply = {"error": f"bad pull request: {err}"}
                try:
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        try:
            self._server = Server((host, port), Handler)
        except OSError as err:
            raise OSError(f"SageKVConnector: cannot listen for pulls on {host}:{port}: {err}") from None
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="sage-vllm-pull-server", daemon=True)
        self._thread.start()

    def _answer(self, line: bytes) -> dict:
        body = json.loads(line)
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        if self.token is not None:
            auth = body.pop("auth", None)
            if not isinstance(auth, str) or not hmac.compare_digest(auth, _sign(self.token, body)):
                self.refused += 1
                return {"error": "refused: the pull request is not signed with this deployment's token"}
        try:
            transfer, first, count, to, wire_id = (body["transfer"], int(body["first"]), int(body["count"]),
                                                   str(body["to"]), str(body["id"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"missing or bad field {err}") from None
        if not to.startswith(("shm://", "tcp://")) or not 0 < len(wire_id) <= 48:
            raise ValueError("'to' must be a shm:// or tcp:// address and 'id' 1-48 characters")
        try:
            rows, keys = self.held.take(str(transfer), first, count)
        except KeyError as err:
            return {"error": err.args[0]}
        self.send(wire_id, to, rows, keys)
        self.pulls += 1
        return {"ok": True}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- consumer worker ------------------------------------------------------------------------------


class PullClient:
    """Sends pull requests off the engine's step (a small thread pool); a refused or unreachable producer
    is reported through `on_failure(wire_id, why)`."""

    def __init__(self, on_failure: Callable[[str, str], None], token: bytes | None = None,
                 timeout_s: float = 5.0) -> None:
        self.on_failure = on_failure
        self.token = token
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sage-vllm-pull")

    def pull(self, address: str, transfer: str, first: int, count: int, to: str, wire_id: str) -> None:
        body = {"transfer": transfer, "first": first, "count": count, "to": to, "id": wire_id}
        if self.token is not None:
            body["auth"] = _sign(self.token, body)
        self._pool.submit(self._pull, address, body, wire_id)

    def _pull(self, address: str, body: dict, wire_id: str) -> None:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s) as sock:
                sock.sendall(json.dumps(body).encode() + b"\n")
                reply = json.loads(sock.makefile("rb").readline(MAX_LINE) or b"{}")
        except (OSError, ValueError) as err:
            self.on_failure(wire_id, f"the producer at {address} did not answer the pull: {err}")
            return
        if not reply.get("ok"):
            self.on_failure(wire_id, f"the producer at {address} refused the pull: {reply.get('error', reply)}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
