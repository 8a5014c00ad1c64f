"""`KVTransfers`: prefill/decode separation, the engine's side of it.

A **prefill** instance runs a request that asks to hold its KV (``KVTransferParams.hold``):
when it finishes (its first token), its blocks are kept instead of freed, until someone
asks for them (`send`: the prompt's full blocks go to a decode instance's pipe) or the
hold expires. They are freed once the receiver verified every chunk, or the send failed.

A **decode** instance runs a request that expects its KV from a transfer
(``KVTransferParams.transfer_id``): the request waits, like one whose prefix is loading
from a lower tier, while the pipe lands the rows; then admission takes them as the
prompt's prefix — written into fresh blocks and registered under the same chained hashes,
so later requests hit them too — and computes only the rest (the last, partial block and
the last token, whose logits give the first token). A transfer that fails or misses its
deadline costs a recompute, never a wrong token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from sage_infer.core.kv_schema import KVDtype
from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.kv_pipe import KVPipe, TransferResult
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.quantized_pool import convert_blocks, convert_rows
from sage_infer.prefix_reuse.hashing import hash_token_blocks

log = logging.getLogger("sage_infer.kv_runtime")


@dataclass(slots=True)
class KVTransferCounters:
    """Totals of an engine's prefill/decode transfers since it started (`KVTransferRole.stats` reports them)."""

    sent: int = 0  # transfers a receiver verified
    send_failures: int = 0
    expired_holds: int = 0  # held KV nobody asked for in time (freed)
    received: int = 0
    receive_failures: int = 0  # the request computed its prompt itself
    hash_mismatches: int = 0  # received blocks whose sender hashes differed from this prompt's (not used)
    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    send_convert_seconds: float = 0.0  # re-encoding blocks into the wire's or the receiver's KV dtype
    receive_convert_seconds: float = 0.0  # the wire's KV dtype into this pool's


@dataclass(frozen=True, slots=True)
class ReceivedKV:
    """A waiting request's prompt blocks that arrived, and their chained hashes (checked equal to the sender's)."""

    rows: torch.Tensor  # [n, block_nbytes] uint8
    block_hashes: list[bytes]  # n of them, from the prompt's first block


@dataclass(slots=True)
class _Held:
    seq: Sequence
    deadline: float
    transfer_id: str | None = None  # set once a send started
    on_done: Callable[[TransferResult], None] | None = None  # told when the send ended


class KVTransfers:
    """Holds, sends and receives whole prompt blocks through one `KVPipe`."""

    def __init__(self, pipe: KVPipe, pool: KVPool, block_size: int, hold_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 extra_key: Callable[[str | None, str], bytes] | None = None,
                 wire_dtype: KVDtype | None = None) -> None:
        self.pipe = pipe  # its schema is the wire's: the pool's, or the pool's blocks in `wire_dtype`
        self.wire_dtype = wire_dtype  # `kv_transport.target_dtype`: blocks travel in it (None: as a pool stores them)
        self.extra_key = extra_key  # (cache_salt, kv_dtype) -> the prefix-cache key part: to convert on send
        self.pool = pool
        self.block_size = block_size
        self.hold_timeout_s = hold_timeout_s
        self.clock = clock
        self.held: dict[str, _Held] = {}  # request id -> its finished sequence, blocks kept
        self.sending: dict[str, str] = {}  # transfer id -> request id
        self.expecting: dict[str, Sequence] = {}  # transfer id -> the waiting sequence
        self.received: dict[int, ReceivedKV] = {}  # seq id -> the prompt's first blocks
        self.stats = KVTransferCounters()
        self.wake = threading.Event()  # set when the pipe finished something (or a command came in)
        self._held_lock = threading.Lock()  # `send` may run on a server thread
        pipe.on_result = self.wake.set

    # -- prefill ----------------------------------------------------------------------------------

    def hold(self, seq: Sequence) -> None:
        """`seq` finished; keep its blocks for a decode instance (freed by `poll` when sent or expired)."""
        with self._held_lock:
            self.held[seq.request_id] = _Held(seq, self.clock() + self.hold_timeout_s)

    def send(self, request_id: str, address: str, transfer_id: str,
             on_done: Callable[[TransferResult], None] | None = None, kv_dtype: str | None = None) -> int:
        """Start sending a held request's full prompt blocks to the pipe at `address`; how many blocks.

        `on_done` hears the result (verified by the receiver, or the error) from `poll`. A receiver
        whose pool holds another `kv_dtype` gets the blocks converted to it (through fp32), hashed
        under its key, as a prefill in bf16 and a decode in int8 (say) need. With a `wire_dtype` the
        blocks travel in it (`convert_blocks`, the pool's own codec); the receiver stores them as they
        are when its pool keeps that dtype, else converts them to its pool's (`poll`).

        Safe to call from a thread other than the engine's (a server answering a pull at once
        rather than between two steps): a held sequence's blocks are neither written nor freed
        until its send ends, and the bookkeeping is under a lock.
        """
        with self._held_lock:
            entry = self.held.get(request_id)
            if entry is None:
                raise KeyError(f"no KV is held for request {request_id!r} (never held, already sent, or expired)")
            if entry.transfer_id is not None:
                raise ValueError(f"request {request_id!r} is already being sent as {entry.transfer_id!r}")
            seq = entry.seq
            n = self.num_blocks(seq)
            if n == 0:
                raise ValueError(f"request {request_id!r} has no full prompt block to send")
            own = self.pool.schema.dtype.value
            target = kv_dtype or own  # what the receiver's pool keeps: the key its hashes are under
            if target == own:
                key = None  # its full prompt blocks were registered in the prefix cache (P/D requires it)
            elif self.extra_key is None:
                raise ValueError(f"this engine cannot convert its KV to {kv_dtype} (no prefix-cache key to hash it)")
            else:
                key = self.extra_key(seq.cache_salt, target)
            ids, hashes = self.blocks(seq, key)
            entry.transfer_id = transfer_id  # from here on the hold cannot expire under us
            entry.on_done = on_done
            self.sending[transfer_id] = request_id
        wire = self.wire_dtype.value if self.wire_dtype is not None else target
        if target == own and wire == own:
            rows = self.pool.read_blocks(ids).view(torch.uint8).reshape(n, -1)
            self.pipe.start_send(transfer_id, address, rows, hashes, ids)
            return n
        schema = self.pool.schema.with_dtype(KVDtype(wire))  # a wire dtype of its own: the receiver converts back
        start = time.perf_counter()
        rows = convert_blocks(self.pool, ids, schema)
        self.stats.send_convert_seconds += time.perf_counter() - start
        self.pipe.start_send(transfer_id, address, rows, hashes, ids, schema)
        return n

    def num_blocks(self, seq: Sequence) -> int:
        """Blocks a transfer of `seq`'s prompt carries: its full ones."""
        return seq.num_prompt_tokens // self.block_size

    def blocks(self, seq: Sequence, extra_key: bytes | None) -> tuple[list[int], list[bytes]]:
        """A held `seq`'s blocks to send and the hash of each under `extra_key` (None: the ones it was
        registered under), in the order they travel."""
        n = self.num_blocks(seq)
        if extra_key is None:
            return seq.block_table[:n], seq.block_hashes[:n]
        return seq.block_table[:n], hash_token_blocks(seq.token_ids[: n * self.block_size], self.block_size,
                                                      extra_key, None)

    # -- decode -----------------------------------------------------------------------------------

    def expect(self, seq: Sequence, transfer_id: str, deadline_s: float | None = None) -> int:
        """`seq` waits for its prompt's full blocks from `transfer_id`; how many blocks it expects."""
        n = self.num_blocks(seq)
        if n == 0:
            raise ValueError("the prompt has no full block: there is no KV to receive")
        self.pipe.expect(transfer_id, n, deadline_s)
        self.expecting[transfer_id] = seq
        return n

    def is_receiving(self, seq: Sequence) -> bool:
        return any(s is seq for s in self.expecting.values())

    def give_up(self, transfer_id: str, why: str) -> bool:
        """Stop waiting for `transfer_id` (its sender said it cannot come): the request computes its prompt."""
        seq = self.expecting.pop(transfer_id, None)
        if seq is None:
            return False
        self.pipe.cancel(transfer_id)
        self.stats.receive_failures += 1
        log.warning("KV transfer %s will not arrive (the request computes its prompt): %s", transfer_id, why)
        return True

    def cancel(self, seq: Sequence) -> None:
        """`seq` ended (aborted) while its KV was on its way: stop waiting; late chunks are dropped."""
        for transfer_id, waiting in list(self.expecting.items()):
            if waiting is seq:
                del self.expecting[transfer_id]
                self.pipe.cancel(transfer_id)
        self.received.pop(seq.seq_id, None)

    # -- both -------------------------------------------------------------------------------------

    def poll(self, free: Callable[[Sequence], None]) -> None:
        """Take what the pipe finished; `free` releases a held sequence's blocks."""
        for result in self.pipe.poll_sent():
            with self._held_lock:
                request_id = self.sending.pop(result.transfer_id, None)
                entry = self.held.pop(request_id, None) if request_id is not None else None
            if entry is not None:
                free(entry.seq)
                if entry.on_done is not None:
                    entry.on_done(result)
            if result.ok:
                self.stats.sent += 1
                self.stats.bytes_sent += result.nbytes
                self.stats.send_seconds += result.seconds
            else:
                self.stats.send_failures += 1
                log.warning("KV transfer %s failed: %s", result.transfer_id, result.error)
        for result in self.pipe.poll_received():
            seq = self.expecting.pop(result.transfer_id, None)
            if seq is None:
                continue
            if result.ok and self.pipe.schema != self.pool.schema:  # the wire's format -> the pool's
                start = time.perf_counter()
                result = replace(result, rows=convert_rows(result.rows, self.pipe.schema, self.pool.schema))
                self.stats.receive_convert_seconds += time.perf_counter() - start
            received = self._verified(seq, result) if result.ok else None
            if received is not None:
                self.received[seq.seq_id] = received
                self.stats.received += 1
                self.stats.bytes_received += result.nbytes
                self.stats.receive_seconds += result.seconds
            elif not result.ok:
                self.stats.receive_failures += 1
                log.warning("KV transfer %s did not arrive (the request computes its prompt): %s",
                            result.transfer_id, result.error)
        now = self.clock()
        with self._held_lock:
            expired = [rid for rid, entry in self.held.items() if entry.transfer_id is None and now >= entry.deadline]
            expired = [self.held.pop(rid) for rid in expired]
        for entry in expired:
            free(entry.seq)
            self.stats.expired_holds += 1

    def _verified(self, seq: Sequence, result: TransferResult) -> ReceivedKV | None:
        """The leading rows whose sender hash equals the hash this engine computes for that block of the
        prompt (same tokens, same model/dtype/salt key), with those hashes; None when not even the first
        agrees. A disagreement (a prefill instance with another cache_salt or revision, say) is counted and
        the rest is computed."""
        n = result.rows.shape[0]
        own = hash_token_blocks(seq.token_ids[: n * self.block_size], self.block_size, seq.extra_key, None)
        agree = next((i for i, (a, b) in enumerate(zip(own, result.block_hashes)) if a != b), n)
        if agree == n and len(result.block_hashes) == n:
            return ReceivedKV(result.rows, own)
        self.stats.hash_mismatches += 1
        log.warning("KV transfer %s: the sender's block hashes differ from this prompt's from block %d of %d; "
                    "the request computes the rest", result.transfer_id, agree, n)
        if agree == 0:
            self.stats.receive_failures += 1
            return None
        return ReceivedKV(result.rows[:agree], own[:agree])

    @property
    def busy(self) -> bool:
        """Something is in flight or held: the engine should keep stepping."""
        return bool(self.held or self.expecting)

    def close(self) -> None:
        self.pipe.close()
