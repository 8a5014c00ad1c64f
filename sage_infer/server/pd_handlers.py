"""Prefill/decode separation at the HTTP boundary (`sage llm serve --role prefill|decode`).

The router drives a request through two instances, as vLLM's disaggregated proxy does:

1. to a **prefill** instance, the request with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``: it computes the prompt and the first
   token, *holds* the prompt's KV, and answers with ``kv_transfer_params`` naming the held
   request and the KV schema;
2. to a **decode** instance, the original request with ``kv_transfer_params`` =
   ``{"remote_url": <prefill URL>, "remote_request_id": ..., "schema_digest": ...}``: it
   queues the request to wait for its KV, registers where the blocks will land, then asks
   the prefill instance (``POST /v1/kv/send``, with this deployment's API key) to send them
   to its connector. The blocks arrive over the transport (checksummed chunks), become a
   prefix hit, and decoding continues. If they never come, the request computes its prompt
   itself when the transfer's deadline passes: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import httpx

from sage_infer.core.messages import GiveUpKV, KVTransferInfo, KVTransferParams, SendKV
from sage_infer.interfaces.backend import BackendError, InferenceBackend, InvalidRequestError, KVTransferBackend
from sage_infer.server.openai_errors import APIError
from sage_infer.server.pd_auth import pull_is_allowed
from sage_infer.server.protocol import KVMatchRequest, KVSendRequest, SamplingFields

log = logging.getLogger("sage_infer.server")
PULL_TIMEOUT_S = 60.0  # the prefill instance answers /v1/kv/send when the receiver verified the KV


class PDHandlers:
    """What a prefill or decode instance does with ``kv_transfer_params``; a no-op without a role."""

    def __init__(self, backend: InferenceBackend, api_key: str | None, allowed_peers: Sequence[str] = ()) -> None:
        self.backend = backend
        self.api_key = api_key
        self.allowed_peers = frozenset(allowed_peers)  # origins (pd_auth.origin) pulled from without a signature
        self.info: KVTransferInfo | None = (backend.kv_transfer_info() if isinstance(backend, KVTransferBackend)
                                            else None)
        # a backend whose own KV connector moves the KV (vLLM with SageKVConnector): its role, no /v1/kv/send
        self.connector_role: str | None = getattr(backend, "pd_role", None)
        self._client: httpx.AsyncClient | None = None  # one pooled client for pulls (made on the server's loop)
        self._pulls: set[asyncio.Task] = set()

    def params(self, body: SamplingFields, num_prompts: int, rid: str) -> KVTransferParams | None:
        """The engine-side transfer of a request (None: an ordinary request), or a 400."""
        fields = body.kv_transfer_params
        if fields is None:
            return None
        role = self.info.role if self.info is not None else self.connector_role or "both"
        if num_prompts != 1:
            raise APIError(400, "kv_transfer_params: prefill/decode separation runs one prompt per request",
                           "kv_transfer_params")
        if fields.do_remote_decode:
            if role != "prefill":
                raise APIError(400, f"kv_transfer_params.do_remote_decode: this instance's role is {role}, not "
                               "prefill", "kv_transfer_params")
            if body.stream or body.n != 1:
                raise APIError(400, "kv_transfer_params.do_remote_decode: the prefill step runs n=1 and does not "
                               "stream", "kv_transfer_params")
            return KVTransferParams(hold=True)
        if self.connector_role is not None and (fields.remote_url is not None or fields.do_remote_prefill):
            if role != "decode":
                raise APIError(400, f"kv_transfer_params: this instance's role is {role}, not decode",
                               "kv_transfer_params")
            if not fields.do_remote_prefill or fields.sage_pd is None:
                return None  # the prefill instance held nothing (a prompt under one block): compute it here
            # vLLM reports remote_prefill_cached_tokens as this request's cached tokens; without it, the tokens
            # it did not compute (the pulled ones), as a native decode instance does
            return KVTransferParams(connector={"do_remote_prefill": True, "sage_pd": fields.sage_pd})
        if fields.remote_url is not None:
            if role != "decode":
                raise APIError(400, f"kv_transfer_params.remote_url: this instance's role is {role}, not decode",
                               "kv_transfer_params")
            if not pull_is_allowed(self.api_key, self.allowed_peers, fields.remote_url,
                                   fields.remote_request_id or "", fields.signature):
                why = ("not signed by this deployment's router nor in kv_transport.allowed_peers (a decode worker "
                       "sends its API key only to a prefill instance its router named or its operator listed)"
                       if self.api_key else "not in kv_transport.allowed_peers")
                raise APIError(403, f"kv_transfer_params.remote_url: {why}", "kv_transfer_params")
            if fields.schema_digest is not None and fields.schema_digest != self.info.schema_digest:
                raise APIError(400, "kv_transfer_params.schema_digest: the prefill instance's KV blocks differ "
                               "from this one's (model, block size or KV groups)", "kv_transfer_params")
            # the wire header holds 48 bytes of transfer id: a fresh uuid, not the (longer) request id
            return KVTransferParams(transfer_id=uuid.uuid4().hex, schema_digest=fields.schema_digest)
        return None

    def held_reply(self, request_id: str) -> dict:
        """What a prefill instance adds to its response: how the decode instance finds the KV."""
        if self.connector_role is not None:
            return self.backend.held_params(request_id) or {"do_remote_prefill": False}
        return {"remote_request_id": request_id, "schema_digest": self.info.schema_digest,
                "kv_dtype": self.info.kv_dtype}

    def pull_soon(self, body: SamplingFields, transfer: KVTransferParams) -> None:
        """`pull` in the background (the task is kept until it ends)."""
        task = asyncio.get_running_loop().create_task(self.pull(body, transfer))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def pull(self, body: SamplingFields, transfer: KVTransferParams) -> None:
        """Decode side: ask the prefill instance to send the held KV to this instance's connector.

        The prefill instance answers once the blocks were verified here (200) or the send
        failed; on a failure the request stops waiting at once and computes its prompt itself.
        """
        fields = body.kv_transfer_params
        send = {"request_id": fields.remote_request_id, "address": self.info.address,
                "transfer_id": transfer.transfer_id}
        if fields.kv_dtype is not None and fields.kv_dtype.value != self.info.kv_dtype:
            send["kv_dtype"] = self.info.kv_dtype  # the prefill instance converts its blocks to this one's
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        why = None
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=PULL_TIMEOUT_S)
        try:
            reply = await self._client.post(f"{fields.remote_url.rstrip('/')}/v1/kv/send", json=send, headers=headers)
            if reply.status_code != 200:
                why = f"the prefill instance answered {reply.status_code}: {reply.text[:200]}"
        except httpx.HTTPError as err:
            why = f"the prefill instance at {fields.remote_url} did not answer: {err or type(err).__name__}"
        if why is not None:
            self.backend.give_up_kv(GiveUpKV(transfer.transfer_id, why))

    def match(self, body: KVMatchRequest, validator) -> dict:
        """``POST /v1/kv/match``: prompt tokens cached here and this instance's queue, for a KV-aware router."""
        ids = validator.match_ids(body)
        overlap = self.backend.prefix_overlap(ids, body.cache_salt) if isinstance(self.backend, KVTransferBackend) \
            else 0
        stats = self.backend.stats()
        return {"cached_tokens": overlap, "prompt_tokens": len(ids), "num_running": stats.num_running,
                "num_waiting": stats.num_waiting, "kv_usage": stats.kv_usage}

    def hashes(self, body: KVMatchRequest, validator) -> dict:
        """``POST /v1/kv/hashes``: the prompt's block hashes, as ``/v1/kv/events`` names them."""
        if not isinstance(self.backend, KVTransferBackend):
            raise APIError(404, "this backend does not report KV block hashes")
        ids = validator.match_ids(body)
        hashes = self.backend.block_hashes(ids, body.cache_salt)
        recipe = self.backend.kv_recipe() or {}
        block_size = recipe.get("block_size") or ((len(ids) - 1) // len(hashes) if hashes else 0)
        return {"hashes": hashes, "prompt_tokens": len(ids), "tokens_per_hash": block_size}

    def events(self, since: int) -> dict:
        """``GET /v1/kv/events?since=N``: what the prefix cache stored ("+hash") and removed ("-hash")."""
        batch = self.backend.kv_events(since) if isinstance(self.backend, KVTransferBackend) else None
        if batch is None:
            raise APIError(404, "this instance does not publish KV events (only prefill workers do)")
        return {"next": batch.next, "reset": batch.reset, "events": batch.events}

    async def send(self, body: KVSendRequest) -> dict:
        """Prefill side of ``POST /v1/kv/send``."""
        if self.info is None or self.info.role != "prefill":
            raise APIError(404, "this instance holds no KV for others (its role is not prefill)")
        try:
            kv_dtype = body.kv_dtype.value if body.kv_dtype is not None else None
            blocks = await self.backend.send_kv(SendKV(body.request_id, body.address, body.transfer_id, kv_dtype))
        except InvalidRequestError as err:
            raise APIError(404, str(err), "request_id") from None
        except BackendError as err:
            raise APIError(503, str(err)) from None
        return {"request_id": body.request_id, "transfer_id": body.transfer_id, "num_blocks": blocks}
