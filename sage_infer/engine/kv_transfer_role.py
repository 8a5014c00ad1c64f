"""An engine's side of prefill/decode separation: its KV-transfer role.

`KVTransferRole` is what a prefill or decode instance does besides serving: check a request's
``kv_transfer`` against this engine, expect a prompt's blocks from a transfer (decode), send a
held request's blocks to a decode instance (prefill), give up on a transfer, report the transfers'
counters. Without a role an engine has none (`LLMEngine.pd` is None).

The engine assembles it (`engine/build.py`); the server's P/D routes reach it through `NativeBackend`.
"""

from __future__ import annotations

from sage_infer.core.messages import KVTransferInfo, KVTransferParams
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.errors import RequestError
from sage_infer.kv_runtime.transfers import KVTransfers


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
                               f"engine's {self.schema_digest[:12]}... (model, block size or KV groups differ)")
        if transfer.hold and params.n != 1:  # (a decode request may have n > 1: its siblings share the prefix)
            raise RequestError("kv_transfer: a request that holds its KV for a decode instance must have n=1")

    def expect(self, seq: Sequence, transfer_id: str) -> None:
        """Decode: `seq` waits for its prompt's blocks from `transfer_id` (a prompt under one block has none)."""
        if self.transfers.num_blocks(seq):
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
                "kv_transfers": (("send", t.sent, t.send_failures, t.bytes_sent, t.send_seconds,
                                  t.send_convert_seconds),
                                 ("receive", t.received, t.receive_failures, t.bytes_received, t.receive_seconds,
                                  t.receive_convert_seconds)),
                "kv_transfer_expired_holds": t.expired_holds, "kv_transfer_hash_mismatches": t.hash_mismatches}
