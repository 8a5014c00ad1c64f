"""An engine's side of prefill/decode separation and of the KV-aware router.

`KVTransferRole` is what a prefill or decode instance does besides serving: check a request's
``kv_transfer`` against this engine, expect a prompt's blocks from a transfer (decode), send a
held request's blocks to a decode instance (prefill), give up on a transfer, report the transfers'
counters. Without a role an engine has none (`LLMEngine.pd` is None).

`PrefixView` is what a router asks of any engine with prefix caching: how many of a prompt's
tokens its device cache holds now, the cache's stored/removed events, and a prompt's block hashes
as those events name them.

The engine assembles both (`engine/build.py`); the server's P/D and router routes reach them
through `NativeBackend`.
"""

from __future__ import annotations

from sage_infer.core.messages import KVTransferInfo, KVTransferParams
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.errors import RequestError
from sage_infer.kv_runtime.transfers import KVTransfers
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import ExtraKeys, prompt_block_hashes
from sage_infer.prefix_reuse.index import PrefixReuseIndex


class KVTransferRole:
    """A prefill instance (holds and sends prompt KV) or a decode instance (receives it), over `transfers`."""

    def __init__(self, transfers: KVTransfers, schema_digest: str, kv_dtype: str) -> None:
        self.transfers = transfers
        self.schema_digest = schema_digest  # what both ends of a transfer must agree on (`LLMEngine.kv_schema_digest`)
        self.kv_dtype = kv_dtype
        self.role = "decode" if transfers.pipe.address is not None else "prefill"

    def info(self) -> KVTransferInfo:
        """The role, the pipe's address (decode: where senders connect), the schema digest, the KV dtype."""
        return KVTransferInfo(self.role, self.transfers.pipe.address, self.schema_digest, self.kv_dtype)

    def check(self, transfer: KVTransferParams, params: SamplingParams) -> None:
        """A request's ``kv_transfer`` this engine cannot take raises `RequestError` (before anything is queued)."""
        if transfer.schema_digest is not None and transfer.schema_digest != self.schema_digest:
            raise RequestError(f"kv_transfer: the sender's KV schema {transfer.schema_digest[:12]}... is not this "
                               f"engine's {self.schema_digest[:12]}... (model, dtype or block size differ)")
        if transfer.hold and params.n != 1:  # (a decode request may have n > 1: its siblings share the prefix)
            raise RequestError("kv_transfer: a request that holds its KV for a decode instance must have n=1")

    def expect(self, seq: Sequence, transfer_id: str) -> None:
        """Decode: `seq` waits for its prompt's full blocks from `transfer_id` (a prompt under one block has none)."""
        if seq.num_prompt_tokens >= self.transfers.block_size:
            self.transfers.expect(seq, transfer_id)

    def send(self, request_id: str, address: str, transfer_id: str, on_done=None, kv_dtype: str | None = None) -> int:
        """Prefill: send a finished, held request's prompt blocks to a decode engine; how many blocks.
        `on_done(result)` is called from a later step when the receiver verified them (or it failed);
        `kv_dtype`: the receiver's KV dtype, when it differs from this engine's (the blocks are converted).
        Safe from another thread (see `KVTransfers.send`)."""
        try:
            return self.transfers.send(request_id, address, transfer_id, on_done, kv_dtype)
        except (KeyError, ValueError) as err:
            raise RequestError(str(err.args[0]) if err.args else str(err)) from None

    def give_up(self, transfer_id: str, why: str) -> bool:
        """Decode: the KV of `transfer_id` will not come; its request computes the prompt now."""
        return self.transfers.give_up(transfer_id, why)

    def wake(self) -> None:
        """Cut an idle step's wait for the pipe short (another thread queued work)."""
        self.transfers.wake.set()

    def registries(self) -> list:
        """The KV pipe's transport registry, for the server's /metrics."""
        return [self.transfers.pipe.telemetry.registry]

    def stats(self) -> dict:
        """The transfers' counters, as `EngineStats` fields."""
        t = self.transfers.stats
        return {"kv_transfer_role": self.role,
                "kv_transfers": (("send", t.sent, t.send_failures, t.bytes_sent, t.send_seconds),
                                 ("receive", t.received, t.receive_failures, t.bytes_received, t.receive_seconds)),
                "kv_transfer_expired_holds": t.expired_holds, "kv_transfer_hash_mismatches": t.hash_mismatches}


class PrefixView:
    """What a KV-aware router reads of an engine's device prefix cache (`index` None: prefix caching off)."""

    def __init__(self, index: PrefixReuseIndex | None, block_size: int, extra_key: ExtraKeys,
                 num_blocks: int = 0) -> None:
        self.index = index
        self.block_size = block_size
        self.num_blocks = num_blocks  # the device pool's capacity (a router weighs what a miss would evict)
        self.extra_key = extra_key

    def overlap(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Prompt tokens whose KV the device cache holds now. Records nothing; safe to call from another thread
        (dict reads; a concurrent eviction only makes the answer stale)."""
        if self.index is None or not token_ids:
            return 0
        return self.index.match(token_ids, self.extra_key(cache_salt), record=False).num_tokens

    def events(self, since: int):
        """Stored/removed block hashes since event `since` (an `EventBatch`), or None when not logged."""
        events = self.index.events if self.index is not None else None
        return events.since(since) if events is not None else None

    def read_events(self, since: int):
        """Every medium's events since event `since`, or the whole current set (an `EventRead`); None when not
        logged."""
        events = self.index.events if self.index is not None else None
        return events.read(since) if events is not None else None

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        """The short hashes of the prompt blocks a prefix hit could cover (all full blocks before the last token),
        as `events` reports them: a router matches one against the other."""
        return [short(h) for h in prompt_block_hashes(token_ids, self.block_size, self.extra_key(cache_salt))]

    def recipe(self) -> dict | None:
        """How this engine names its blocks, for a router that hashes token-id prompts itself: the block size and
        the parts of the extra key (`prefix_reuse.hashing.ExtraKeys`) besides a request's cache salt; and how many
        blocks its device holds."""
        if self.index is None:
            return None
        key = self.extra_key
        return {"block_size": self.block_size, "model_id": key.model_id, "revision": key.revision,
                "kv_dtype": key.kv_dtype, "layout": key.layout, "num_blocks": self.num_blocks}
