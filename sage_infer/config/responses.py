"""`ResponsesConfig`: what the server keeps of `/v1/responses` conversations (`docs/responses.md`)."""

from __future__ import annotations

from pydantic import Field

from sage_infer.config.hardware import Strict


class ResponsesConfig(Strict):
    """Stored responses (`store: true`, the default) and the KV kept for their next turn (`previous_response_id`)."""

    ttl_s: float = Field(3600.0, gt=0, le=30 * 86400, description="How long a stored response can be retrieved "
                         "or continued; its KV is retained as long (device blocks evicted only when nothing else is "
                         "left, then demoted to a lower tier like any evicted block).")
    max_stored: int = Field(1024, ge=0, le=1_000_000, description="Stored responses kept at most (all tenants); past "
                            "it the oldest is dropped, with its KV retention. 0: nothing is stored (store is "
                            "refused).")
    max_stored_bytes: int = Field(256 << 20, ge=0, description="Bytes of stored items (their JSON) kept at most; "
                                  "past it the oldest responses are dropped.")
    kv_share: float = Field(0.5, ge=0, le=1, description="Most of the device KV pool that retained conversations "
                            "may hold ahead of other traffic; past it the oldest retention ends. 0: no KV retention "
                            "(stored items only).")
